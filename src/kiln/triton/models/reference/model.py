"""Triton Python model ``tensorrt_llm`` for kiln's ``reference`` target: the quantized model on the CPU.

kiln copies this file into generated repositories as ``tensorrt_llm/1/model.py``, with ``kiln_triton_utils.py``
beside it (the only other module it imports from kiln's source; it must not import kiln).
It serves the same tensors as upstream's ``tensorrt_llm`` model, so the ensemble, the BLS model and every
client work unchanged. It is the correctness path for machines without a GPU, never the fast path.

Runtime. The Hugging Face model in ``model_dir`` is loaded with ``sdpa`` attention and, when
``modelopt_state.pth`` is there, ModelOpt's quantizers are restored onto it (``mto.restore``: fake-quant,
the same numbers as calibration). Requests run under transformers' continuous batching with a paged KV
cache: one persistent manager, requests join and leave the running batch between steps (in-flight
batching), sized from the parameters below. A dispatcher thread routes each step's tokens to the Triton
request it belongs to; a request cancelled by its client is cancelled in the manager.

Sampling. transformers' manager samples or not for all requests at once (``do_sample`` is manager-wide,
and so is its random generator), so kiln runs it greedy (argmax) and does per-request sampling in its own
logits processor: temperature, then top-k, then top-p, then one draw through the Gumbel-max trick with the
request's own ``torch.Generator`` (seeded from ``seed``), after which only the drawn token is left for the
argmax. Greedy requests are untouched, so they equal ``model.generate(do_sample=False)`` exactly, and a
seeded request gives the same tokens whatever else is in the batch. As in TensorRT-LLM, a request samples
only when ``runtime_top_k`` > 1 or ``runtime_top_p`` > 0 (both unset or 0 means greedy) and temperature is
not 0. The same processor adds ``embedding_bias``, applies ``bad_words_list`` and ``min_tokens`` and computes
log-probabilities.

Contract. The config declares every input and output of upstream's ``tensorrt_llm`` model. Inputs for what
this runtime cannot do are refused with an error naming the feature, the target and the input (``UNSUPPORTED``
below: context/generation logits, LoRA, prompt tuning, guided and lookahead decoding, encoder-decoder and
multimodal inputs, ...), as are beam_width > 1, num_return_sequences > 1 and non-neutral
repetition/presence/frequency penalties. ``decoder_input_ids``/``decoder_input_lengths`` are ignored, as
TensorRT-LLM ignores them for decoder-only models. ``return_num_input_tokens``/``return_num_output_tokens``
add ``num_input_tokens`` (prompt tokens) and ``num_output_tokens`` (tokens in this response: the new ones
when streaming) to every response.

Batches. A request of batch > 1 is answered as upstream's tensorrtllm backend answers it (tensorrtllm_backend
c2e65b8, inflight_batcher_llm/src/model_instance_state.cc): each item's responses on their own (output_ids
[1, 1, L], sequence_length [1, 1]) with ``batch_index`` [[i]] when the client asks for it; an item's last response
is final only for the last item to end; a model that is not decoupled refuses batch > 1, as upstream's does.

Other behaviour. The end id is not part of the output (as in TensorRT-LLM); generation stops after a
``stop_words_list`` sequence, which is kept. ``exclude_input_in_output`` (request input, else the parameter,
else false) drops the prompt from non-streaming outputs; streaming responses carry only new tokens. A
streamed chunk never ends inside a UTF-8 character (checked with the model's tokenizer, if it has a
``tokenizer.json``): it is held back for at most a few tokens until the character is complete, so
stateless postprocessing decodes chunks correctly. ``draft_input_ids`` (draft-target speculative decoding
driven by tensorrt_llm_bls): the model generates at most len(draft)+1 tokens and stops at the first token
that differs from the draft, returning the accepted draft tokens plus its own next token, which is what
TensorRT-LLM's verification returns (it runs them as decode steps, so there is no speed-up here).
Cancellation: a request whose client cancelled (``request.is_cancelled()``, polled every
``cancellation_check_period_ms`` under the lock every response send takes, and only for requests that have not
sent their final response: the llmapi model's discipline) or that a ``stop`` request names by request id (upstream's mechanism,
used by tensorrt_llm_bls) is cancelled in the manager, freeing its KV blocks.

Prompt scoring (kiln's extension of the contract, for the OpenAI server's ``echo``/loglikelihood requests): an
optional input ``return_prompt_log_probs`` BOOL[1]; when true, the request is answered at once, without
generating, with ``prompt_log_probs`` FP32[n] (entry j: log-prob of prompt token j given the tokens before it;
entry 0 is 0, it has no context), ``prompt_top_ids`` INT32[n+1] and ``prompt_top_log_probs`` FP32[n+1] (entry j:
the argmax token of the distribution predicting position j and its log-prob; entry 0 is -1 / 0, entry n is the
greedy next token). transformers' continuous-batching manager exposes only the last position's logits, so a
second copy of the same model (same weights, ModelOpt state and dtype), loaded on the first such request, runs one
plain forward over the prompt: only these 3 x n numbers leave the model, never the context logits.

Parameters (config.pbtxt, strings): ``model_dir`` (required), ``modelopt_state`` (file in model_dir,
default ``modelopt_state.pth``; ``none`` loads the unquantized model), ``dtype`` (float32|bfloat16|float16,
default float32), ``max_batch_size`` (requests per step; default the config's max_batch_size),
``tokens_per_block`` (KV block size, default 32), ``max_num_tokens`` (tokens per step, default 2048),
``max_tokens_in_paged_kv_cache`` (KV cache size in tokens, default 8192), ``enable_kv_cache_reuse``
(prefix sharing, default true), ``max_seq_len`` (optional limit on prompt + output), ``exclude_input_in_output``
(default false), ``num_threads`` (torch threads, default: all cores), ``cancellation_check_period_ms``
(default 100), ``tokenizer_dir`` (for streaming chunk boundaries, default model_dir).
"""

from kiln_triton_utils import use_utf8_locale

use_utf8_locale()  # ModelOpt's imports read files that need UTF-8

import os  # noqa: E402

# Before torch loads its OpenMP runtime: idle OpenMP workers sleep instead of spinning. This model runs its
# own threads (generation, dispatch) beside the stub's, often on few and shared cores; with spinning workers
# a 2-thread step measured 5-10x slower than with one thread, with sleeping workers it is faster than one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import time  # noqa: E402

_MODULE_IMPORT_START = time.monotonic()  # module-level imports (torch, transformers) count as model imports

import json  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from kiln_triton_utils import (  # noqa: E402
    REPLACEMENT,
    RequestError,
    get_bool_param,
    get_int_param,
    get_param,
    input_array,
    last_error_line,
    refuse_unsupported,
    requested,
    resolve_path,
)
from transformers.generation.continuous_batching.cb_logits_processors import (  # noqa: E402
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from reference_sampling import Sampling, bad_word_mask_ids, make_sampling, process_row  # noqa: E402, F401
from transformers.generation.logits_process import LogitsProcessorList  # noqa: E402

_MODULE_IMPORT_SECONDS = time.monotonic() - _MODULE_IMPORT_START

#: Longest a streamed chunk is held back waiting for the rest of a UTF-8 character (a character is <= 4 bytes).
MAX_HOLD_TOKENS = 4
_TARGET = "by the reference target"
#: Inputs of upstream's tensorrt_llm contract this runtime accepts but cannot act on: (rule, message). Inputs
#: not listed here are either used (see _parse) or ignored as TensorRT-LLM ignores them for a decoder-only
#: model (decoder_input_ids/_lengths) or at beam width 1 (len_penalty, early_stopping, beam_search_diversity_rate).
UNSUPPORTED = {
    "encoder_input_features": ("nonempty", f"encoder input features (encoder-decoder models) are not supported {_TARGET}"),
    "encoder_output_lengths": ("present", f"encoder output lengths (encoder-decoder models) are not supported {_TARGET}"),
    "draft_logits": ("nonempty", f"draft logits (logit-comparison speculative decoding) are not supported {_TARGET}"),
    "draft_acceptance_threshold": ("present", f"draft acceptance thresholds (logit-comparison speculative "
                                              f"decoding) are not supported {_TARGET}"),
    "return_context_logits": ("true", f"context logits are not produced {_TARGET}"),
    "return_generation_logits": ("true", f"generation logits are not produced {_TARGET}"),
    "return_perf_metrics": ("true", f"per-request performance metrics are not produced {_TARGET}"),
    "prompt_embedding_table": ("nonempty", f"prompt tuning (prompt embedding tables) is not supported {_TARGET}"),
    "prompt_vocab_size": ("present", f"prompt tuning (prompt_vocab_size) is not supported {_TARGET}"),
    "prompt_table_extra_ids": ("nonzero", f"prompt tuning (prompt table extra ids) is not supported {_TARGET}"),
    "cross_attention_mask": ("nonempty", f"cross-attention masks (encoder-decoder models) are not supported {_TARGET}"),
    "skip_cross_attn_blocks": ("true", f"skipping cross-attention blocks is not supported {_TARGET}"),
    "mrope_rotary_cos_sin": ("nonempty", f"multimodal rotary embeddings (mrope) are not supported {_TARGET}"),
    "mrope_position_deltas": ("present", f"multimodal rotary embeddings (mrope) are not supported {_TARGET}"),
    "lora_task_id": ("present", f"LoRA adapters are not supported {_TARGET}"),
    "lora_weights": ("nonempty", f"LoRA adapters are not supported {_TARGET}"),
    "lora_config": ("nonempty", f"LoRA adapters are not supported {_TARGET}"),
    "context_phase_params": ("nonempty", f"disaggregated serving (context phase parameters) is not supported {_TARGET}"),
    "guided_decoding_guide_type": ("nonempty", f"guided decoding is not supported {_TARGET}"),
    "guided_decoding_guide": ("nonempty", f"guided decoding is not supported {_TARGET}"),
    "lookahead_window_size": ("present", f"lookahead decoding is not supported {_TARGET}"),
    "lookahead_ngram_size": ("present", f"lookahead decoding is not supported {_TARGET}"),
    "lookahead_verification_set_size": ("present", f"lookahead decoding is not supported {_TARGET}"),
    "runtime_top_p_decay": (("not", 1.0), f"top-p decay (runtime_top_p_decay) is not supported {_TARGET}"),
    "runtime_top_p_reset_ids": (("not", -1), f"top-p decay (runtime_top_p_reset_ids) is not supported {_TARGET}"),
    **{name: ("present", f"KV-cache retention priorities are not supported {_TARGET}")
       for name in ("retention_token_range_starts", "retention_token_range_ends", "retention_token_range_priorities",
                    "retention_token_range_durations_ms", "retention_decode_priority", "retention_decode_duration_ms")},
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------- parameters
@dataclass
class RuntimeSettings:
    """Everything the model reads from config.pbtxt."""

    model_dir: str
    state_file: str | None
    dtype: str
    max_batch_size: int
    tokens_per_block: int
    max_num_tokens: int
    kv_cache_tokens: int
    kv_cache_reuse: bool
    max_seq_len: int | None
    exclude_input_in_output: bool
    num_threads: int
    cancellation_check_period_ms: int
    tokenizer_dir: str
    decoupled: bool
    output_names: tuple

    @property
    def num_blocks(self):
        return max(1, math.ceil(self.kv_cache_tokens / self.tokens_per_block))


def _restored_model(s):
    """The Hugging Face model in ``model_dir`` (sdpa attention, eval mode) with its ModelOpt state restored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=_DTYPES[s.dtype], attn_implementation="sdpa")
    model.eval()
    if s.state_file:
        import modelopt.torch.opt as mto

        mto.restore(model, s.state_file)
    return model


def read_settings(model_config, args=None):
    """Parse and check the parameters; errors name the parameter and say what is expected."""
    model_dir = resolve_path(args or {}, get_param(model_config, "model_dir"))
    if model_dir is None:
        raise ValueError(
            "tensorrt_llm (reference): parameter 'model_dir' is not set in config.pbtxt "
            "(missing, empty or an unfilled ${...})"
        )
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"tensorrt_llm (reference): {model_dir}/config.json not found (model_dir must be a HF model)")
    state = get_param(model_config, "modelopt_state", "modelopt_state.pth")
    state_file = None
    if state.lower() != "none":
        state_file = state if os.path.isabs(state) else os.path.join(model_dir, state)
        if not os.path.isfile(state_file):
            raise ValueError(
                f"tensorrt_llm (reference): ModelOpt state {state_file} not found; write it with "
                "modelopt.torch.opt.save(model, path), or set parameter modelopt_state to 'none' for an "
                "unquantized model"
            )
    dtype = get_param(model_config, "dtype", "float32").lower()
    if dtype not in _DTYPES:
        raise ValueError(f"parameter 'dtype' must be one of {sorted(_DTYPES)}, got {dtype!r}")
    triton_max_batch = int(model_config.get("max_batch_size", 0) or 0)
    return RuntimeSettings(
        model_dir=model_dir,
        state_file=state_file,
        dtype=dtype,
        max_batch_size=get_int_param(model_config, "max_batch_size", max(triton_max_batch, 1), minimum=1),
        tokens_per_block=get_int_param(model_config, "tokens_per_block", 32, minimum=4),
        max_num_tokens=get_int_param(model_config, "max_num_tokens", 2048, minimum=1),
        kv_cache_tokens=get_int_param(model_config, "max_tokens_in_paged_kv_cache", 8192, minimum=1),
        kv_cache_reuse=get_bool_param(model_config, "enable_kv_cache_reuse", True),
        max_seq_len=get_int_param(model_config, "max_seq_len", None, minimum=1),
        exclude_input_in_output=get_bool_param(model_config, "exclude_input_in_output", False),
        num_threads=get_int_param(model_config, "num_threads", os.cpu_count() or 1, minimum=1),
        cancellation_check_period_ms=get_int_param(model_config, "cancellation_check_period_ms", 100, minimum=1),
        tokenizer_dir=resolve_path(args or {}, get_param(model_config, "tokenizer_dir", model_dir)),
        decoupled=bool(model_config.get("model_transaction_policy", {}).get("decoupled", False)),
        output_names=tuple(out["name"] for out in model_config.get("output", [])),
    )


# ---------------------------------------------------------------------------------------------- sampling
# Sampling, make_sampling, bad_word_mask_ids and process_row live in reference_sampling.py.

class KilnSampler(ContinuousBatchingLogitsProcessor):
    """Per-request sampling inside transformers' continuous batching (see the module docstring).

    ``prepare_tensor_args`` is called (manager thread) with the requests whose next token the coming step
    predicts, in logits-row order; ``__call__`` then gets those rows. Requests are looked up by id.
    """

    supported_kwargs = {}
    ignored_kwargs = ()

    def __init__(self):
        self._specs = {}
        self._rows = []
        self._lock = threading.Lock()

    def register(self, request_id, spec):
        with self._lock:
            self._specs[request_id] = spec

    def forget(self, request_id):
        with self._lock:
            self._specs.pop(request_id, None)

    def fill_defaults(self, int32_tensor):
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_with_new_token):
        self._rows = [fs.state for fs in requests_with_new_token]
        return torch.zeros(len(self._rows), dtype=torch.int32)

    def __call__(self, scores, tensor_arg):
        with self._lock:
            specs = [self._specs.get(state.request_id) for state in self._rows]
        for i, (state, spec) in enumerate(zip(self._rows[: scores.size(0)], specs)):
            if spec is not None and spec.touches_logits and spec.error is None:
                try:
                    process_row(scores[i], spec, list(state.initial_tokens) + list(state.generated_tokens))
                except Exception as err:  # an exception here would stop the manager for every request
                    spec.error = f"{type(err).__name__}: {err}"
        return scores


class _SamplerList(ContinuousBatchingLogitsProcessorList):
    """The manager's processor list, holding only KilnSampler (one int32 argument row)."""

    def __init__(self, sampler):
        super().__init__(LogitsProcessorList([sampler]), per_request_processors=False)
        self.tensors_required = 1


# ---------------------------------------------------------------------------------------------- requests
from reference_requests import Job, Sequence, _default_ids, _request_id, _requested, _scalars, word_lists  # noqa: E402, F401


# ---------------------------------------------------------------------------------------------- the model
class TritonPythonModel:
    """In-flight batched generation on the CPU behind upstream's ``tensorrt_llm`` tensor contract."""

    def initialize(self, args):
        t0 = time.monotonic()
        self.model_config = json.loads(args["model_config"])
        self.settings = s = read_settings(self.model_config, args)
        torch.set_num_threads(s.num_threads)
        self.model = self._load_model(s)
        t_load = time.monotonic() - t0
        self.default_end_id, self.default_pad_id = _default_ids(s.model_dir, self.model.config)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.tokenizer = self._load_tokenizer(s.tokenizer_dir)
        self.sampler = KilnSampler()
        self.mgr = self._start_manager(s)
        # Guards the job tables and every response send: a final response releases the request (and its response
        # factory), and is_cancelled() on a released request can crash the stub or the server (seen with the
        # llmapi model), so the cancellation poll and the sends exclude each other and the poll only asks jobs
        # that have not sent their final response. Re-entrant: a cancellation found by the poll finishes the job.
        self._lock = threading.RLock()
        self._jobs = {}  # id(job) -> job
        self._by_rid = {}  # manager request id -> (job, sequence)
        self._stop = threading.Event()
        self._broken = None
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="kiln-dispatch", daemon=True)
        self._dispatcher.start()
        pb_utils.Logger.log_info(
            f"tensorrt_llm (reference): {s.model_dir} ({s.dtype}, "
            f"{'ModelOpt state ' + os.path.basename(s.state_file) if s.state_file else 'unquantized'}) "
            f"loaded in {t_load:.1f}s (imports {self.load_times['imports']:.1f}s, weights and ModelOpt state "
            f"{self.load_times['weights']:.1f}s), ready in {time.monotonic() - t0:.1f}s; paged KV cache "
            f"{s.num_blocks} blocks x {s.tokens_per_block} tokens, {s.max_num_tokens} tokens/step, "
            f"{s.max_batch_size} requests/step, {s.num_threads} threads, decoupled={s.decoupled}"
        )

    # ------------------------------------------------------------------ set-up
    def _load_model(self, s):
        t0 = time.monotonic()
        from transformers import AutoModelForCausalLM  # noqa: F401  (imported first: timed apart from the weights)

        if s.state_file:
            import modelopt.torch.opt as mto  # noqa: F401
        t1 = time.monotonic()
        model = _restored_model(s)
        self.load_times = {"imports": _MODULE_IMPORT_SECONDS + (t1 - t0), "weights": time.monotonic() - t1}
        return model

    @staticmethod
    def _load_tokenizer(tokenizer_dir):
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        if not os.path.isfile(path):
            pb_utils.Logger.log_warn(
                f"tensorrt_llm (reference): no {path}; streamed chunks may end inside a UTF-8 character"
            )
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)

    def _start_manager(self, s):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen = GenerationConfig(
            do_sample=False, max_new_tokens=16, eos_token_id=self.default_end_id, pad_token_id=self.default_pad_id
        )
        cb = ContinuousBatchingConfig(
            block_size=s.tokens_per_block,
            num_blocks=s.num_blocks,
            max_batch_tokens=s.max_num_tokens,
            max_requests_per_batch=s.max_batch_size,
            allow_block_sharing=s.kv_cache_reuse,
            use_async_batching=False,
            use_cuda_graph=False,
            max_blocks_per_request=0,
        )
        mgr = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        mgr.logit_processor = _SamplerList(self.sampler)  # before start(): the batch processor is built from it
        mgr.start()
        return mgr

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                stop = input_array(request, "stop")
                if stop is not None and np.asarray(stop).any():
                    self._stop_request(request, sender)
                    continue
                if self._broken is not None:
                    raise RequestError(f"the reference runtime failed and cannot serve: {self._broken}")
                score = input_array(request, "return_prompt_log_probs")
                if score is not None and np.asarray(score).any():
                    self._score(request, sender)
                    continue
                job = self._parse(request, sender)
                self._submit(job)
            except RequestError as err:
                self._send_error(sender, str(err))
            except Exception:
                pb_utils.Logger.log_error(f"tensorrt_llm (reference): {traceback.format_exc()}")
                self._send_error(sender, f"internal error: {last_error_line()}")
        return None

    def _parse(self, request, sender):
        s = self.settings
        refuse_unsupported(request, UNSUPPORTED)
        ids = input_array(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is missing")
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        batch = ids.shape[0]
        lengths = _scalars(request, "input_lengths", batch, int)
        out_lens = _scalars(request, "request_output_len", batch, int)
        if out_lens[0] is None:
            raise RequestError("request_output_len is missing")
        end_ids = _scalars(request, "end_id", batch, int)
        pad_ids = _scalars(request, "pad_id", batch, int)
        streaming = any(v for v in _scalars(request, "streaming", batch, bool) if v)
        if batch > 1 and not s.decoupled:  # upstream's C++ backend refuses it too (inflight_batcher_llm/src/utils.cc)
            raise RequestError("Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction "
                               "policy")
        if streaming and not s.decoupled:
            raise RequestError("streaming needs the model's config.pbtxt to set model_transaction_policy.decoupled")
        exclude = _scalars(request, "exclude_input_in_output", batch, bool)[0]
        exclude = s.exclude_input_in_output if exclude is None else exclude
        want_logprobs = any(v for v in _scalars(request, "return_log_probs", batch, bool) if v)
        for name in ("beam_width", "num_return_sequences"):
            for value in _scalars(request, name, batch, int):
                if value not in (None, 1):
                    raise RequestError(f"{name}={value} is not supported {_TARGET} (only 1)")
        for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            for value in _scalars(request, name, batch, float):
                if value is not None and value != neutral:
                    raise RequestError(f"{name}={value} is not supported {_TARGET} (only the neutral {neutral})")
        temps = _scalars(request, "temperature", batch, float)
        top_ks = _scalars(request, "runtime_top_k", batch, int)
        top_ps = _scalars(request, "runtime_top_p", batch, float)
        seeds = _scalars(request, "seed", batch, int, "random_seed")
        min_tokens = _scalars(request, "min_tokens", batch, int, "min_length")
        stops = word_lists(input_array(request, "stop_words_list"), batch)
        bads = word_lists(input_array(request, "bad_words_list"), batch)
        biases = self._biases(input_array(request, "embedding_bias"), batch)
        drafts = input_array(request, "draft_input_ids")
        if drafts is not None:
            drafts = np.asarray(drafts).reshape(batch, -1)

        seqs = []
        for i in range(batch):
            n = ids.shape[1] if lengths[i] is None else lengths[i]
            if not 1 <= n <= ids.shape[1]:
                raise RequestError(f"input_lengths[{i}]={n} must be between 1 and the input_ids width {ids.shape[1]}")
            prompt = [int(t) for t in ids[i, :n]]
            self._check_ids(prompt, "input_ids")
            max_new = out_lens[i]
            if max_new is None or max_new < 1:
                raise RequestError(f"request_output_len must be at least 1, got {max_new}")
            self._check_fits(len(prompt), max_new, i)
            end_id = self.default_end_id if end_ids[i] is None else end_ids[i]
            draft = None
            if drafts is not None and drafts.shape[1] > 0:
                draft = [int(t) for t in drafts[i]]
                self._check_ids(draft, "draft_input_ids")
                max_new = min(max_new, len(draft) + 1)
            for word in bads[i]:
                self._check_ids(word, "bad_words_list")
            sampling = make_sampling(
                temps[i],
                top_ks[i],
                top_ps[i],
                seeds[i],
                min_tokens=max(min_tokens[i] or 0, 0),
                end_id=end_id,
                prompt_len=len(prompt),
                bad_words=bads[i],
                want_logprobs=want_logprobs,
                bias=biases[i],
            )
            seqs.append(
                Sequence(
                    rid=f"kiln-{uuid.uuid4().hex}",
                    prompt=prompt,
                    max_new=max_new,
                    end_id=end_id,
                    pad_id=self.default_pad_id if pad_ids[i] is None else pad_ids[i],
                    sampling=sampling,
                    stop_words=stops[i],
                    draft=draft,
                )
            )
        counts = tuple(requested(input_array(request, n), "true")
                       for n in ("return_num_input_tokens", "return_num_output_tokens"))
        return Job(request, sender, streaming, bool(exclude), want_logprobs, seqs, triton_id=_request_id(request),
                   want_counts=counts, per_item=batch > 1, want_index=batch > 1 and _requested(request, "batch_index"))

    def _score(self, request, sender):
        """Prompt scoring (module docstring): one forward of a second, unmanaged copy of the model."""
        ids = input_array(request, "input_ids")
        if ids is None:
            raise RequestError("input_ids is missing")
        ids = np.asarray(ids)
        ids = ids[None] if ids.ndim == 1 else ids.reshape(ids.shape[0], -1)
        if ids.shape[0] != 1:
            raise RequestError(f"return_prompt_log_probs scores one prompt per request, got a batch of {ids.shape[0]}")
        n = _scalars(request, "input_lengths", 1, int)[0]
        prompt = [int(t) for t in ids[0, : ids.shape[1] if n is None else n]]
        if not prompt:
            raise RequestError("input_ids is empty: nothing to score")
        self._check_ids(prompt, "input_ids")
        self._check_fits(len(prompt), 1, 0)
        if getattr(self, "_scorer", None) is None:
            self._scorer = _restored_model(self.settings)
        with torch.no_grad():
            x = torch.tensor([prompt])
            logits = self._scorer(x, attention_mask=torch.ones_like(x)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)  # row j: the distribution of token j+1
        top_lp, top_ids = lp.max(dim=-1)
        rows = torch.arange(len(prompt) - 1)
        chosen = [0.0] + lp[rows, torch.tensor(prompt[1:], dtype=torch.long)].tolist()
        names = self.settings.output_names
        values = {
            "prompt_log_probs": np.array([chosen], dtype=np.float32),
            "prompt_top_ids": np.array([[-1] + top_ids.tolist()], dtype=np.int32),
            "prompt_top_log_probs": np.array([[0.0] + top_lp.tolist()], dtype=np.float32),
        }
        missing = [k for k in values if k not in names]
        if missing:
            raise RequestError(f"return_prompt_log_probs: this model's config.pbtxt does not declare {missing}")
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in values.items()])
        self._send(sender, response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _biases(self, array, batch):
        """Per batch item, the embedding_bias [vocab] tensor, or None (absent or empty: no bias)."""
        if array is None or np.asarray(array).size == 0:
            return [None] * batch
        array = np.asarray(array, dtype=np.float32)
        array = array.reshape(array.shape[0] if array.ndim > 1 else 1, -1)
        if array.shape[0] == 1 and batch > 1:
            array = np.repeat(array, batch, axis=0)
        if array.shape[0] != batch or array.shape[1] > self.vocab_size:
            raise RequestError(
                f"embedding_bias must be [batch, at most {self.vocab_size}] (the vocabulary), got {array.shape}"
            )
        return [torch.from_numpy(row.copy()) if row.any() else None for row in array]

    def _stop_request(self, request, sender):
        """Upstream's ``stop`` input: cancel the running request that has this request's id (BLS uses it)."""
        triton_id = _request_id(request)
        if not triton_id:
            raise RequestError("a stop request needs the request id of the request to stop")
        with self._lock:
            jobs = [job for job in self._jobs.values() if job.triton_id == triton_id]
        for job in jobs:
            pb_utils.Logger.log_info(f"tensorrt_llm (reference): request {triton_id!r} stopped by a stop request")
            self._cancel_job(job)
        self._send(sender, None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _cancel_job(self, job):
        for seq in job.seqs:
            if not seq.done:
                seq.done = True
                self.mgr.cancel_request(seq.rid)
        self._finish(job, None)

    def _check_ids(self, ids, name):
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def _check_fits(self, prompt_len, max_new, index):
        s = self.settings
        where = f" (batch item {index})" if index else ""
        total = prompt_len + max_new
        if s.max_seq_len is not None and total > s.max_seq_len:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + request_output_len ({max_new}){where} exceeds max_seq_len "
                f"{s.max_seq_len}"
            )
        capacity = s.num_blocks * s.tokens_per_block
        if math.ceil(total / s.tokens_per_block) > s.num_blocks:
            raise RequestError(
                f"prompt ({prompt_len} tokens) + request_output_len ({max_new}){where} needs {total} KV-cache "
                f"tokens, but the cache holds {capacity} (max_tokens_in_paged_kv_cache); ask for fewer tokens"
            )

    def _submit(self, job):
        with self._lock:
            self._jobs[id(job)] = job
            for seq in job.seqs:
                self._by_rid[seq.rid] = (job, seq)
                self.sampler.register(seq.rid, seq.sampling)
        try:
            for seq in job.seqs:
                added = self.mgr.add_request(
                    seq.prompt, request_id=seq.rid, max_new_tokens=seq.max_new, streaming=True, eos_token_id=seq.end_id
                )
                if added is None:
                    raise RuntimeError("the generation loop is stopping")
        except Exception as err:  # e.g. the manager's queue stayed full, or it is shutting down
            self._fail_job(job, f"could not schedule the request: {err}")

    # ------------------------------------------------------------------ results (dispatcher thread)
    def _dispatch_loop(self):
        period = self.settings.cancellation_check_period_ms / 1000.0
        next_check = time.monotonic() + period
        while not self._stop.is_set():
            try:
                out = self.mgr.get_result(timeout=min(period, 0.05))
                if out is not None:
                    self._on_output_safely(out)
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + period
                    self._check_cancelled()
                    self._check_manager()
            except Exception:
                pb_utils.Logger.log_error(f"tensorrt_llm (reference) dispatcher: {traceback.format_exc()}")

    def _on_output_safely(self, out):
        try:
            self._on_output(out)
        except Exception:
            pb_utils.Logger.log_error(f"tensorrt_llm (reference): {traceback.format_exc()}")
            with self._lock:
                entry = self._by_rid.get(out.request_id)
            if entry is not None:
                self._fail_job(entry[0], f"internal error: {last_error_line()}")

    def _on_output(self, out):
        with self._lock:
            entry = self._by_rid.get(out.request_id)
        if entry is None:
            return  # cancelled or already finished
        job, seq = entry
        if out.error is not None or int(out.status) == 4:  # RequestStatus.FAILED
            self._fail_job(job, f"generation failed: {out.error}")
            return
        if seq.sampling.error is not None:
            self._fail_job(job, f"sampling failed: {seq.sampling.error}")
            return
        was_done = seq.done
        if seq.update(out.generated_tokens, out.is_finished()) and not was_done and not out.is_finished():
            self.mgr.cancel_request(seq.rid)  # stopped early (stop word, draft mismatch): free its KV blocks
        if seq.done:
            self._release(seq)
        if job.per_item:
            self._send_item(job, seq)
        elif job.streaming:
            self._send_stream(job)
        elif all(x.done for x in job.seqs):
            self._finish(job, self._response(job, final=True))

    def _release(self, seq):
        with self._lock:
            self._by_rid.pop(seq.rid, None)
        self.sampler.forget(seq.rid)

    def _releasable(self, seq):
        """How many pending tokens of a streamed sequence can be sent without splitting a UTF-8 character."""
        pending = seq.tokens[seq.streamed :]
        if seq.done or not pending or self.tokenizer is None:
            return len(pending)
        text = self.tokenizer.decode(pending, skip_special_tokens=False)
        if text.endswith(REPLACEMENT) and len(pending) < MAX_HOLD_TOKENS:
            return 0
        return len(pending)

    def _send_stream(self, job):
        counts = [self._releasable(seq) for seq in job.seqs]
        final = all(seq.done for seq in job.seqs)
        if not any(counts):
            if final:
                self._finish(job, None)
            return
        response = self._response(job, final=final, counts=counts)
        for seq, n in zip(job.seqs, counts):
            seq.streamed += n
        if final:
            self._finish(job, response)
        else:
            self._send_job(job, response)

    def _send_item(self, job, seq):
        """Batch > 1, as upstream's backend answers it: each item's responses on their own ([1, 1, L] output_ids,
        ``batch_index`` [[i]] when asked for); an item's last response is final only for the last item to end."""
        if seq.item_final:
            return
        i = job.seqs.index(seq)
        if job.streaming:
            n = self._releasable(seq)
            if not n and not seq.done:
                return
            response = self._response(job, final=seq.done, counts={i: n})
            seq.streamed += n
        elif seq.done:
            response = self._response(job, final=True, counts={i: None})
        else:
            return
        if not seq.done:
            self._send_job(job, response)
            return
        with self._lock:
            seq.item_final = True
            if all(x.item_final for x in job.seqs):
                self._finish(job, response)
            else:
                self._send_job(job, response)

    def _send_job(self, job, response):
        """A non-final response, unless the job has finished (a cancellation may have sent its final one)."""
        with self._lock:
            if not job.finished:
                self._send(job.sender, response, 0)

    def _response(self, job, final, counts=None):
        """output_ids [batch, 1, L], sequence_length [batch, 1] (+ log-prob outputs when asked for and declared).

        ``counts`` (streaming): send each sequence's next ``counts[i]`` unsent tokens; otherwise the whole output.
        """
        items = sorted(counts) if isinstance(counts, dict) else range(len(job.seqs))  # dict: one batch item
        seqs = [job.seqs[i] for i in items]
        if isinstance(counts, dict):
            counts = [counts[i] for i in items] if counts[items[0]] is not None else None
        rows, lps = [], []
        for i, seq in enumerate(seqs):
            if counts is not None:
                start, stop = seq.streamed, seq.streamed + counts[i]
                rows.append(seq.tokens[start:stop])
                lps.append(seq.sampling.logprobs[start:stop])
            else:
                rows.append(([] if job.exclude_input else seq.prompt) + seq.tokens)
                lps.append(seq.sampling.logprobs[: len(seq.tokens)])
        width = max([len(r) for r in rows] + [1 if counts is None else 0])
        out = np.empty((len(rows), 1, width), dtype=np.int32)
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            out[i, 0, :] = seq.pad_id
            out[i, 0, : len(row)] = row
        tensors = [
            pb_utils.Tensor("output_ids", out),
            pb_utils.Tensor("sequence_length", np.array([[len(r)] for r in rows], dtype=np.int32)),
        ]
        names = self.settings.output_names
        if job.per_item and job.want_index and "batch_index" in names:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[items[0]]], dtype=np.int32)))
        if job.want_counts[0] and "num_input_tokens" in names:
            prompt_lens = np.array([[len(seq.prompt)] for seq in seqs], dtype=np.int32)
            tensors.append(pb_utils.Tensor("num_input_tokens", prompt_lens))
        if job.want_counts[1] and "num_output_tokens" in names:  # tokens in this response (streaming: new ones)
            sent = [counts[i] if counts is not None else len(seq.tokens) for i, seq in enumerate(seqs)]
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[n] for n in sent], dtype=np.int32)))
        if job.want_logprobs and "cum_log_probs" in names:
            cum = np.array([[float(sum(seq.sampling.logprobs[: len(seq.tokens)]))] for seq in seqs], np.float32)
            tensors.append(pb_utils.Tensor("cum_log_probs", cum))
        if job.want_logprobs and "output_log_probs" in names:
            lp_width = max([len(x) for x in lps] + [0])
            arr = np.zeros((len(lps), 1, lp_width), dtype=np.float32)
            for i, x in enumerate(lps):
                arr[i, 0, : len(x)] = x
            tensors.append(pb_utils.Tensor("output_log_probs", arr))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _finish(self, job, response):
        """Send the job's final response once, under the lock (see self._lock)."""
        with self._lock:
            if job.finished:
                return
            job.finished = True
            self._jobs.pop(id(job), None)
            for seq in job.seqs:
                self._release(seq)
            self._send(job.sender, response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _fail_job(self, job, message):
        for seq in job.seqs:
            if not seq.done:
                seq.done = True
                self.mgr.cancel_request(seq.rid)
        with self._lock:
            if job.finished:
                return
            job.finished = True
            self._jobs.pop(id(job), None)
            for seq in job.seqs:
                self._release(seq)
            self._send_error(job.sender, message)

    def _check_cancelled(self):
        with self._lock:  # no final response can be sent while the poll asks (see self._lock)
            for job in list(self._jobs.values()):
                if job.finished:
                    continue
                try:
                    cancelled = job.request.is_cancelled()
                except Exception:
                    cancelled = False
                if cancelled:
                    pb_utils.Logger.log_info("tensorrt_llm (reference): request cancelled by the client")
                    self._cancel_job(job)

    def _check_manager(self):
        error = getattr(self.mgr, "fatal_error", None)
        if error is None and self.mgr.is_running():
            return
        self._broken = error or "the generation thread stopped"
        pb_utils.Logger.log_error(f"tensorrt_llm (reference): generation loop failed: {self._broken}")
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._fail_job(job, f"the reference runtime failed: {self._broken}")

    # ------------------------------------------------------------------ sending
    @staticmethod
    def _send(sender, response, flags):
        try:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)
        except Exception as err:  # the client may be gone (cancelled); nothing else to do
            pb_utils.Logger.log_warn(f"tensorrt_llm (reference): could not send a response: {err}")

    def _send_error(self, sender, message):
        response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
        self._send(sender, response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        """Stop the dispatcher and the manager's (non-daemon) thread; fail what is still running."""
        self._stop.set()
        self._dispatcher.join(timeout=5)
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._fail_job(job, "the model is being unloaded")
        try:
            self.mgr.stop(block=True, timeout=30, hard_stop=True)
            self.mgr.destroy()
        except Exception:
            pb_utils.Logger.log_error(f"tensorrt_llm (reference): stopping the manager: {traceback.format_exc()}")
        pb_utils.Logger.log_info("tensorrt_llm (reference): finalized")
