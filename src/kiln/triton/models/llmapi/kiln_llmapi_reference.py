"""kiln's CPU reference runtime for the llmapi model (target pytorch): a TEST AND DEVELOPMENT VEHICLE, not a fast
path. It stands in for ``tensorrt_llm.LLM`` where there is no GPU, behind the same Triton tensor contract, so the
whole pytorch path (recipe → unified checkpoint → Triton llmapi repository → tokens) runs and is tested on a CPU.

It loads ModelOpt's unified Hugging Face checkpoint itself, the files TensorRT-LLM's PyTorch backend loads, and
never the ModelOpt state: ``hf_quant_config.json`` names the format, and ``kiln_dequantize.json`` (written beside
this file from kiln's format registry) says how it is stored; quantized weights are dequantized (FP8:
``weight × weight_scale``; INT4 AWQ: two int4 values per byte, ``× weight_scale`` per group; W4A8 AWQ: that, then
the FP8 step of ``weight_scale_2``), activations keep what the format quantizes (``pre_quant_scale``, and the FP8
``input_scale`` of FP8 and W4A8), and an FP8 KV cache quantizes keys and values with the exported
``k_scale``/``v_scale``. Its logits match the ModelOpt-restored model's to float rounding for the weight formats
(tests/test_llmapi_reference.py states the tolerance); an FP8 activation or KV step can round the other way.

The engine has the LLM API's shape as kiln's llmapi model.py uses it: ``generate_async(prompt, sampling_params=…,
streaming=…)`` returns a request output that is iterated with ``async for`` (the text is cumulative, as the LLM
API's ``CompletionOutput.text`` is) and can be ``abort()``-ed; ``shutdown()``. Requests run one at a time on one
generation thread (greedy, or seeded temperature / top-k / top-p sampling); a prompt longer than max_num_tokens
(without chunked prefill) or one that leaves no room for max_tokens within max_seq_len is refused, as the PyTorch
backend refuses it (max_input_len limits nothing there); stop strings end a completion
(``finish_reason`` "stop", ``stop_reason`` the string, not included in the text), as does the end token.
It imports torch, transformers, safetensors and tokenizers; never ModelOpt, TensorRT-LLM or kiln.
"""

import asyncio
import json
import math
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

FP8_MAX = 448.0
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Scale tensors of a quantized linear layer in the unified checkpoint (consumed with its weight).
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
KV_SCALES = {"k_proj.k_scale": "k_scale", "v_proj.v_scale": "v_scale"}
#: How each quant_algo is stored (written beside this file by kiln's package step from its format registry).
LAYOUTS_FILE = "kiln_dequantize.json"
ATTENTION = "kiln_fp8_kv"


class ReferenceError(ValueError):
    """A checkpoint or request this runtime cannot serve; the message says why."""


# ---------------------------------------------------------------------------------------------- checkpoint
def fp8_round(x, scale):
    """Quantize to FP8 (E4M3) with ``scale`` and back: what an FP8 tensor holds, in ``x``'s dtype."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


def unpack_int4(packed, out_features):
    """ModelOpt's ``pack_int4_in_uint8``: [out/2, in] bytes, output channel 2j in the low nibble and 2j+1 in the
    high one, two's complement → [out, in] float values in [-8, 7]."""
    p = packed.to(torch.int16)
    values = torch.stack([p & 0x0F, (p >> 4) & 0x0F], dim=1).reshape(out_features, -1)
    return torch.where(values >= 8, values - 16, values).to(torch.float32)


class DequantizedLinear(torch.nn.Module):
    """A linear layer of a unified checkpoint: dequantized weight, the activation steps the format keeps."""

    def __init__(self, weight, bias, pre_quant_scale=None, input_scale=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.register_buffer("pre_quant_scale", pre_quant_scale)
        self.register_buffer("input_scale", input_scale)

    def forward(self, x):
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.input_scale is not None:
            x = fp8_round(x, self.input_scale.to(x.dtype))
        return torch.nn.functional.linear(x, self.weight, self.bias)


def read_quant_config(path):
    """The ``quantization`` section of ``hf_quant_config.json`` ({} for an unquantized checkpoint)."""
    file = os.path.join(path, "hf_quant_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as fh:
        return json.load(fh).get("quantization") or {}


def read_layouts(path=None):
    """The dequantization layouts kiln wrote beside this file: {"weights": {quant_algo: layout}, "kv_cache": {...}}."""
    path = path or os.path.join(os.path.dirname(os.path.abspath(__file__)), LAYOUTS_FILE)
    if not os.path.isfile(path):
        raise ReferenceError(f"{path} not found: kiln's package step writes it beside model.py")
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _dequantize(layout, algo, weight, scales, out_features, group_size):
    scale = scales["weight_scale"].float()
    if layout["weights"] == "fp8":
        dense = weight.float() * scale
    elif layout["weights"] == "int4_packed":
        if not group_size:
            raise ReferenceError(f"{algo} checkpoint without a group_size in hf_quant_config.json")
        values = unpack_int4(weight, out_features)
        dense = values * scale.repeat_interleave(int(group_size), dim=1)[:, : values.shape[1]]
    else:
        raise ReferenceError(f"{algo}: weight layout {layout['weights']!r} is not one the reference dequantizes")
    if layout.get("weight_fp8_step"):
        dense = fp8_round(dense, scales["weight_scale_2"].float())
    return dense


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention with the FP8 KV cache's rounding of keys and values (ModelOpt quantizes what the attention
    function receives: the keys after RoPE, the whole cache)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_scale, v_scale = getattr(module, "kiln_k_scale", None), getattr(module, "kiln_v_scale", None)
    if k_scale is not None:
        key = fp8_round(key, k_scale.to(key.dtype))
    if v_scale is not None:
        value = fp8_round(value, v_scale.to(value.dtype))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def load_unified_checkpoint(path, dtype="auto", layouts=None):
    """The model of a unified checkpoint, dequantized by ``layouts`` (default: the file kiln wrote beside this one;
    see the module docstring); returns (model, quantization)."""
    from safetensors.torch import load_file
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    quant = read_quant_config(path)
    algo, kv_algo = quant.get("quant_algo"), quant.get("kv_cache_quant_algo")
    layouts = layouts if layouts is not None else (read_layouts() if algo or kv_algo else {})
    weights, kv_rounding = layouts.get("weights", {}), layouts.get("kv_cache", {})
    if algo is not None and algo not in weights:
        raise ReferenceError(f"quant_algo {algo} is not one the CPU reference runtime runs ({', '.join(weights)})")
    if kv_algo is not None and kv_algo not in kv_rounding:
        raise ReferenceError(f"kv_cache_quant_algo {kv_algo} is not one the CPU reference runtime runs "
                             f"({', '.join(kv_rounding)})")
    cfg.pop("quantization_config", None)  # transformers has no loader for ModelOpt's: kiln dequantizes itself
    config = AutoConfig.for_model(**cfg)
    if dtype in (None, "auto"):
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    if dtype not in _DTYPES:
        raise ReferenceError(f"dtype {dtype!r}: the CPU reference runtime runs {', '.join(_DTYPES)}")
    attention = "sdpa"
    if kv_algo is not None and kv_rounding[kv_algo] == "fp8":
        AttentionInterface.register(ATTENTION, _fp8_kv_attention)
        attention = ATTENTION
    model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype], attn_implementation=attention).eval()
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    if not tensors:
        raise ReferenceError(f"{path} holds no *.safetensors weights")
    modules = dict(model.named_modules())
    plain, used = {}, set()
    for key, tensor in tensors.items():
        prefix, _, attr = key.rpartition(".")
        if attr == "weight" and tensor.dtype in (torch.uint8, torch.float8_e4m3fn, torch.int8):
            linear = modules.get(prefix)
            if not isinstance(linear, torch.nn.Linear):
                raise ReferenceError(f"{key}: a quantized weight of {prefix}, which is not a linear layer here")
            scales = {s: tensors[f"{prefix}.{s}"] for s in SCALE_SUFFIXES if f"{prefix}.{s}" in tensors}
            used.update(f"{prefix}.{s}" for s in scales)
            layout = weights[algo]
            dense = _dequantize(layout, algo, tensor, scales, linear.out_features, quant.get("group_size"))
            act = scales.get("input_scale") if layout.get("activations") == "fp8" else None
            pqs = scales.get("pre_quant_scale")
            new = DequantizedLinear(dense.to(_DTYPES[dtype]), linear.bias,
                                    None if pqs is None else pqs.float(), None if act is None else act.float())
            parent, _, child = prefix.rpartition(".")
            setattr(modules[parent], child, new)
            used.add(key)
            continue
        kv = next((v for k, v in KV_SCALES.items() if key.endswith(k)), None)
        if kv is not None:
            attn = key[: -len(next(k for k in KV_SCALES if key.endswith(k))) - 1]
            setattr(modules[attn], f"kiln_{kv}", tensor.float().reshape(()))
            used.add(key)
    for key, tensor in tensors.items():
        if key not in used:
            plain[key] = tensor
    missing, unexpected = model.load_state_dict(plain, strict=False)
    unexpected = [k for k in unexpected if not k.endswith(SCALE_SUFFIXES)]
    missing = [k for k in missing if not any(k.startswith(p + ".") for p, m in model.named_modules()
                                             if isinstance(m, DequantizedLinear))]
    if getattr(model.config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
    if unexpected or missing:
        raise ReferenceError(f"{path}: weights that do not fit the model: unexpected {unexpected[:5]}, "
                             f"missing {missing[:5]}")
    return model, quant


# ---------------------------------------------------------------------------------------------- the LLM API shape
@dataclass
class SamplingParams:
    """The ``SamplingParams`` keywords kiln's llmapi model passes (those upstream's llmapi model maps from its
    ``sampling_param_*`` inputs), with the LLM API's defaults."""

    max_tokens: int = 32
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    best_of: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    stop: Optional[list] = None
    prompt_logprobs: Optional[int] = None  # top-k log-probs per prompt position (CompletionOutput.prompt_logprobs)

    def __post_init__(self):
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature is not None and (not math.isfinite(self.temperature) or self.temperature < 0):
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            problems.append(f"top_p must be in [0, 1], got {self.top_p}")
        if self.best_of not in (None, 1):
            problems.append(f"best_of={self.best_of}: the CPU reference runtime returns one sequence (best_of 1)")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0.0):
                problems.append(f"{name}={getattr(self, name)} is not supported by the CPU reference runtime")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            problems.append(f"prompt_logprobs must be a count >= 0, got {self.prompt_logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if problems:
            raise ReferenceError("; ".join(problems))

    @property
    def greedy(self):
        """As TensorRT-LLM decides: sampling only with top_k > 1 or 0 < top_p, and a temperature that is not 0."""
        k, p = self.top_k or 0, self.top_p or 0.0
        return self.temperature == 0.0 or k == 1 or (k == 0 and p == 0.0)


@dataclass
class Logprob:
    """TensorRT-LLM's ``Logprob``: a token's log-probability and its rank in the vocabulary (1: the argmax)."""

    logprob: float
    rank: Optional[int] = None


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    #: TensorRT-LLM's TokenLogprobs: per prompt position 1..n-1, {token id: Logprob} for the top-k tokens of the
    #: distribution predicting it and the prompt's own token there.
    prompt_logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[str] = None
    request_perf_metrics: Optional[object] = None


@dataclass
class RequestOutput:
    prompt: str
    outputs: list
    finished: bool = False
    error: Optional[str] = None
    prompt_token_ids: list = field(default_factory=list)


class RequestHandle:
    """What ``generate_async`` returns: ``async for`` its outputs (one per token when streaming, else the final
    one), or ``abort()`` it."""

    def __init__(self, prompt, params, streaming, loop):
        self.prompt, self.params, self.streaming, self.loop = prompt, params, streaming, loop
        self.queue = asyncio.Queue()
        self.aborted = threading.Event()

    def abort(self):
        self.aborted.set()

    def _push(self, output):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if item.error is not None:
            raise ReferenceError(item.error)
        return item


class ReferenceLLM:
    """``tensorrt_llm.LLM``'s place on a CPU: takes the same arguments (model.yaml's), serves one request at a time."""

    def __init__(self, model, tensor_parallel_size=1, pipeline_parallel_size=1, dtype="auto", max_batch_size=None,
                 max_seq_len=None, max_num_tokens=8192, enable_chunked_prefill=False, num_threads=None, **others):
        if tensor_parallel_size * pipeline_parallel_size != 1:
            raise ReferenceError("the CPU reference runtime runs one process: tensor_parallel_size and "
                                 "pipeline_parallel_size must be 1")
        from tokenizers import Tokenizer

        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.model, self.quantization = load_unified_checkpoint(model, dtype)
        self.tokenizer = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        self.tokenizer.no_truncation()  # a prompt is never cut short: it is refused when too long
        self.tokenizer.no_padding()
        self.max_num_tokens = None if enable_chunked_prefill else max_num_tokens
        self.max_seq_len = max_seq_len or getattr(self.model.config, "max_position_embeddings", None)
        self.end_ids = _end_ids(model, self.model.config)
        #: LLM arguments that shape GPU execution only (KV-cache sizing, CUDA graphs, scheduling, speculation).
        self.not_applied = sorted(others)
        self._jobs = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kiln-llmapi-reference", daemon=True)
        self._thread.start()

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        params = sampling_params or SamplingParams()
        handle = RequestHandle(inputs, params, streaming, asyncio.get_running_loop())
        # a prompt is text, or token ids (as the LLM API takes them; Dynamo's frontend tokenizes and sends ids)
        ids = ([int(i) for i in inputs] if isinstance(inputs, (list, tuple))
               else self.tokenizer.encode(inputs, add_special_tokens=True).ids)
        # the PyTorch backend's own checks (LLM._check_arguments; its tests match "should not exceed max_num_tokens")
        if self.max_num_tokens and len(ids) > self.max_num_tokens:
            raise ReferenceError(f"The sum of prompt length ({len(ids)}), query length (0) should not exceed "
                                 f"max_num_tokens ({self.max_num_tokens})")
        if self.max_seq_len and len(ids) + params.max_tokens > self.max_seq_len:
            raise ReferenceError(f"the prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                 f"max_seq_len {self.max_seq_len}")
        self._jobs.put((handle, ids))
        return handle

    def shutdown(self):
        self._jobs.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ generation thread
    def _loop(self):
        while True:
            item = self._jobs.get()
            if item is None:
                return
            handle, ids = item
            try:
                self._generate(handle, ids)
            except Exception as err:  # the request fails; the runtime keeps serving
                handle._push(RequestOutput(handle.prompt, [], True, f"{type(err).__name__}: {err}"))
                handle._push(None)

    def _choose(self, logits, params, generator):
        logp = torch.log_softmax(logits.float(), dim=-1)
        if params.greedy:
            token = int(torch.argmax(logits))
            return token, float(logp[token])
        s = logits.float() / (params.temperature if params.temperature is not None else 1.0)
        k = params.top_k or 0
        if 0 < k < s.numel():
            s = s.masked_fill(s < torch.topk(s, k).values[-1], -math.inf)
        p = params.top_p or 0.0
        if 0.0 < p < 1.0:
            ordered, order = torch.sort(s, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p
            drop[0] = False
            s = s.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
        token = int(torch.multinomial(torch.softmax(s, dim=-1), 1, generator=generator))
        return token, float(logp[token])

    def _generate(self, handle, ids):
        params = handle.params
        generator = torch.Generator()
        if params.seed is not None:
            generator.manual_seed(int(params.seed))
        tokens, cum = [], 0.0
        out = CompletionOutput()
        prefix = [] if params.exclude_input_from_output else list(ids)
        with torch.no_grad():
            step = self.model(input_ids=torch.tensor([ids]), use_cache=True)
            if params.prompt_logprobs is not None:
                out.prompt_logprobs = _prompt_logprobs(step.logits[0, :-1], ids[1:], params.prompt_logprobs)
            while True:
                if handle.aborted.is_set():
                    out.finish_reason = "cancelled"
                    break
                token, logp = self._choose(step.logits[0, -1], params, generator)
                if token in self.end_ids:
                    out.finish_reason = "stop"
                    break
                tokens.append(token)
                cum += logp
                text = self.tokenizer.decode(prefix + tokens, skip_special_tokens=True)
                hit = _stop_hit(text, params.stop, len(self.tokenizer.decode(prefix, skip_special_tokens=True)))
                if hit is not None:
                    out.text, out.finish_reason, out.stop_reason = text[: hit[0]], "stop", hit[1]
                    break
                out.text, out.token_ids, out.cumulative_logprob = text, prefix + tokens, cum
                if len(tokens) >= params.max_tokens:
                    out.finish_reason = "length"
                    break
                if handle.streaming:
                    handle._push(RequestOutput(handle.prompt, [_copy(out)], False, prompt_token_ids=list(ids)))
                step = self.model(input_ids=torch.tensor([[token]]), past_key_values=step.past_key_values,
                                  use_cache=True)
        out.token_ids, out.cumulative_logprob = prefix + tokens, cum
        if out.stop_reason is None and out.finish_reason != "cancelled":
            out.text = self.tokenizer.decode(prefix + tokens, skip_special_tokens=True)
        handle._push(RequestOutput(handle.prompt, [_copy(out)], True, prompt_token_ids=list(ids)))
        handle._push(None)


def _prompt_logprobs(logits, targets, k):
    """TokenLogprobs from the prompt's logits (row j predicts ``targets[j]``): the top-k and the target, ranked."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    rows = []
    for j, target in enumerate(targets):
        row = {}
        if k:
            values, indices = torch.topk(lp[j], k)
            row = {int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(values, indices))}
        if target not in row:
            row[int(target)] = Logprob(float(lp[j, target]), int((lp[j] > lp[j, target]).sum()) + 1)
        rows.append(row)
    return rows


def _copy(out):
    return CompletionOutput(out.index, out.text, list(out.token_ids), out.cumulative_logprob, out.prompt_logprobs,
                            out.finish_reason, out.stop_reason)


def _stop_hit(text, stops, start):
    """(where the first stop string begins in the generated part of ``text``, the string), or None."""
    found = None
    for s in stops or ():
        at = text.find(s, start) if s else -1
        if at >= 0 and (found is None or at < found[0]):
            found = (at, s)
    return found


def _end_ids(model_dir, config):
    ids = None
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            ids = json.load(fh).get("eos_token_id")
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, list) else [ids])}
