"""Triton Python model ``tensorrt_llm_bls``: preprocessing -> tensorrt_llm -> postprocessing in Python (BLS).

kiln copies this file into generated repositories as ``tensorrt_llm_bls/1/model.py``, with
``kiln_triton_utils.py`` beside it (the only other module it imports from kiln's source; it must not import
kiln). Its config declares every input and output of upstream's ``tensorrt_llm_bls``. Inputs go where
upstream's BLS sends them (``REQUEST_TO_PREPROC`` to preprocessing, ``REQUEST_TO_LLM`` to the language model,
``stream`` as ``streaming``); the models there serve them or refuse them with an error naming the feature.
Image and video inputs are refused here: they need a multimodal encoder model, and kiln serves text-only
models. ``text_output`` is one flat array of ``batch × beams`` UTF-8 strings (as upstream), followed by every
other declared output the language model returned (log probs, token counts, metrics, ...).

Streaming text (``stream`` true; needs the BLS config to be decoupled), defined once for both modes of the
``accumulate_tokens`` parameter, as upstream: ``false`` (the default, and what kiln writes) sends per-response
deltas, which clients append; ``true`` sends the full text so far, which clients overwrite (upstream's client
flag ``--overwrite-output-text``). Unlike upstream, both are computed by decoding all tokens so far and
holding back a trailing incomplete UTF-8 character until its bytes have arrived, so no response ever carries
a split character (U+FFFD) and SentencePiece leading spaces survive. One response is sent per response of the
language model (its text may be empty while a character is incomplete), then the held-back rest, if any,
with the final flag.

Each request runs in its own thread, so several requests are in the language model's running batch at
once (``execute`` returns at once; responses go through the request's response sender, which works with
and without a decoupled config).

Parameters: ``tensorrt_llm_model_name`` (default ``tensorrt_llm``), ``tensorrt_llm_draft_model_name``
(enables draft-target speculative decoding), ``num_draft_tokens`` (kiln's: draft length when the request
does not send ``num_draft_tokens`` and a draft model is set; default 4), ``accumulate_tokens`` (default
false), ``preprocessing_model_name`` / ``postprocessing_model_name`` (defaults as named).

Speculative decoding (a request's ``num_draft_tokens`` > 0, or kiln's parameter; batch size 1, as upstream):
the draft model proposes up to N tokens for the text so far; the target model gets them as
``draft_input_ids`` (with ``use_draft_logits``, also the draft's generation logits as ``draft_logits``) and
returns the accepted ones plus one token of its own; repeat until ``max_tokens``, an end token or a stop word.
A request asking for it without a draft model configured is refused, as upstream refuses it. The acceptance
rate is logged per request.

Cancellation: when the client cancels, the BLS stops the language model's request: with the response
iterator's ``cancel()`` where the stub has it, else (Triton 2.51, nvidia-pytriton 0.7) with upstream's
``stop`` request naming the request id, so ``tensorrt_llm``'s config must declare the ``stop`` input.
"""

from kiln_triton_utils import use_utf8_locale

use_utf8_locale()

import json  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from kiln_triton_utils import (  # noqa: E402
    RequestError,
    get_bool_param,
    get_int_param,
    get_param,
    input_array,
    last_error_line,
    refuse_unsupported,
    text_delta,
)

#: BLS input -> preprocessing input (upstream's mapping).
REQUEST_TO_PREPROC = {
    "text_input": "QUERY",
    "decoder_text_input": "DECODER_QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
    "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
    "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
}
#: preprocessing output -> tensorrt_llm input.
PREPROC_TO_LLM = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "DECODER_INPUT_ID": "decoder_input_ids",
    "REQUEST_DECODER_INPUT_LEN": "decoder_input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "BAD_WORDS_IDS": "bad_words_list",
    "STOP_WORDS_IDS": "stop_words_list",
    "EMBEDDING_BIAS": "embedding_bias",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
    "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids",
}
#: BLS input -> tensorrt_llm input (sent only when the client sent it; upstream's mapping, plus the token counts
#: and num_return_sequences, which the language model serves or refuses).
REQUEST_TO_LLM = {
    "beam_width": "beam_width",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "temperature": "temperature",
    "length_penalty": "len_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "return_log_probs": "return_log_probs",
    "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens",
    "return_num_output_tokens": "return_num_output_tokens",
    "num_return_sequences": "num_return_sequences",
    "prompt_embedding_table": "prompt_embedding_table",
    "prompt_vocab_size": "prompt_vocab_size",
    "lora_task_id": "lora_task_id",
    "lora_weights": "lora_weights",
    "lora_config": "lora_config",
    "exclude_input_in_output": "exclude_input_in_output",
    "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
}
PREPROC_OUTPUTS = list(PREPROC_TO_LLM)
#: tensorrt_llm outputs the BLS reads or passes on (each only when its own config declares it).
LLM_OUTPUTS = [
    "output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits", "generation_logits",
    "batch_index", "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks", "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
    "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
    "num_input_tokens", "num_output_tokens",
]
_MULTIMODAL = "needs a multimodal encoder model, and this repository has none: kiln serves text-only models"
#: Inputs upstream sends to a multimodal encoder model: (rule, message).
UNSUPPORTED = {
    name: ("nonempty", f"{what} {_MULTIMODAL}")
    for name, what in (("image_input", "image input"), ("image_bytes_input", "image input"),
                       ("image_url_input", "image input"), ("image_sizes_input", "image input"),
                       ("video_bytes_input", "video input"))
}


def _items(response, batch):
    """The batch items a tensorrt_llm response holds: its ``batch_index`` (one item per response for batch > 1, as
    the tensorrtllm backend and kiln's reference runtime send them), else every item in order."""
    index = _output(response, "batch_index")
    if batch > 1 and index is not None and _output(response, "output_ids").shape[0] == 1:
        return [int(np.asarray(index).reshape(-1)[0])]
    return list(range(batch))


def _batched(value):
    """An input as a BLS call to another model needs it: [batch, ...] (inputs with reshape [] arrive as [batch])."""
    value = np.asarray(value)
    return value.reshape(-1, 1) if value.ndim == 1 else value


def accepted_prefix(new_tokens, draft):
    """How many leading tokens of the target's answer equal the draft."""
    k = 0
    while k < len(new_tokens) and k < len(draft) and new_tokens[k] == draft[k]:
        k += 1
    return k


def stopped_early(new_tokens, draft):
    """True when the target returned only accepted draft tokens (it hit its end token or a stop word).

    A verification that did not stop returns the accepted tokens plus one token of its own.
    """
    return len(new_tokens) == 0 or accepted_prefix(new_tokens, draft) == len(new_tokens) <= len(draft)


def ends_with_stop_word(tokens, stop_words):
    """True when ``tokens`` ends with one of the token sequences in ``stop_words``."""
    return any(word and len(tokens) >= len(word) and list(tokens[-len(word) :]) == list(word) for word in stop_words)


def stop_words_from_tensor(array):
    """Per-word token lists of the first batch item of a [batch, 2, L] stop-words tensor."""
    if array is None or np.asarray(array).size == 0:
        return []
    ids, offsets = np.asarray(array)[0]
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append([int(t) for t in ids[start:end]])
        start = int(end)
    return words


def _output(response, name):
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    return None if tensor is None else tensor.as_numpy()


def _raise_if_error(response, step):
    if response.has_error():
        raise RequestError(f"{step}: {response.error().message()}")


class TritonPythonModel:
    """Python orchestration of the three models; optionally draft-target speculative decoding."""

    def initialize(self, args):
        self.model_config = cfg = json.loads(args["model_config"])
        self.decoupled = bool(cfg.get("model_transaction_policy", {}).get("decoupled", False))
        self.llm = get_param(cfg, "tensorrt_llm_model_name", "tensorrt_llm")
        self.draft = get_param(cfg, "tensorrt_llm_draft_model_name")
        self.preproc = get_param(cfg, "preprocessing_model_name", "preprocessing")
        self.postproc = get_param(cfg, "postprocessing_model_name", "postprocessing")
        self.accumulate = get_bool_param(cfg, "accumulate_tokens", False)
        self.default_draft_tokens = get_int_param(cfg, "num_draft_tokens", 4)
        self.output_names = {out["name"] for out in cfg.get("output", [])}
        #: what the BLS asks the language model for: what it reads, and the declared outputs it passes on
        # batch_index always: a request of batch > 1 is answered one item per response, which the BLS reassembles
        self.llm_outputs = LLM_OUTPUTS[:2] + ["batch_index"] + [n for n in LLM_OUTPUTS[2:]
                                                                if n in self.output_names and n != "batch_index"]
        self._threads = set()
        self._lock = threading.Lock()
        pb_utils.Logger.log_info(
            f"tensorrt_llm_bls: {self.preproc} -> {self.llm}"
            f"{' (draft ' + self.draft + ')' if self.draft else ''} -> {self.postproc}, decoupled={self.decoupled}, "
            f"accumulate_tokens={self.accumulate}"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            thread = threading.Thread(target=self._run, args=(request, sender), daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def _run(self, request, sender):
        try:
            self._serve(request, sender)
        except RequestError as err:
            self._send_error(sender, str(err))
        except Exception:
            pb_utils.Logger.log_error(f"tensorrt_llm_bls: {traceback.format_exc()}")
            self._send_error(sender, f"internal error: {last_error_line()}")
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    # ------------------------------------------------------------------ steps
    def _preprocess(self, request):
        if input_array(request, "text_input") is None:
            raise RequestError("text_input is missing")
        if input_array(request, "max_tokens") is None:
            raise RequestError("max_tokens is missing")
        inputs = []
        for src, dst in REQUEST_TO_PREPROC.items():
            value = input_array(request, src)
            if value is not None:
                if dst in ("REQUEST_OUTPUT_LEN", "END_ID", "PAD_ID"):
                    value = value.astype(np.int32)
                inputs.append(pb_utils.Tensor(dst, _batched(value)))
        req = pb_utils.InferenceRequest(
            model_name=self.preproc, inputs=inputs, requested_output_names=PREPROC_OUTPUTS
        )
        response = req.exec()
        _raise_if_error(response, "preprocessing")
        return {name: _output(response, name) for name in PREPROC_OUTPUTS}

    def _llm_inputs(self, request, pre, streaming):
        tensors = {PREPROC_TO_LLM[name]: value for name, value in pre.items() if value is not None}
        for src, dst in REQUEST_TO_LLM.items():
            value = input_array(request, src)
            if value is not None:
                tensors[dst] = _batched(value)
        tensors["streaming"] = np.full((tensors["input_ids"].shape[0], 1), streaming, dtype=bool)
        return tensors

    def _generate(self, model, tensors, outputs=None):
        """Yield the model's responses (one for a non-streaming request, several when streaming)."""
        request_id = f"kiln-bls-{uuid.uuid4().hex}"
        req = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=[pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in tensors.items()],
            requested_output_names=outputs or self.llm_outputs,
        )
        responses = req.exec(decoupled=True)
        finished = False
        try:
            for response in responses:
                _raise_if_error(response, model)
                if _output(response, "output_ids") is None:
                    continue  # the empty final-flag response
                yield response
            finished = True
        finally:
            if not finished:  # the caller stopped early (the client cancelled): stop the model's request too
                self._stop(model, request_id, responses)

    def _postprocess(self, tokens, lengths):
        """Texts as [batch][beams] for ``tokens`` [batch, beams, n] cut to ``lengths`` [batch, beams]."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        req = pb_utils.InferenceRequest(
            model_name=self.postproc,
            inputs=[
                pb_utils.Tensor("TOKENS_BATCH", tokens),
                pb_utils.Tensor("SEQUENCE_LENGTH", np.ascontiguousarray(lengths, dtype=np.int32)),
            ],
            requested_output_names=["OUTPUT"],
        )
        response = req.exec()
        _raise_if_error(response, "postprocessing")
        flat = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in _output(response, "OUTPUT").reshape(-1)]
        beams = max(len(flat) // max(tokens.shape[0], 1), 1)  # upstream returns batch x beams strings, flat
        return [flat[i : i + beams] for i in range(0, len(flat), beams)]

    # ------------------------------------------------------------------ one request
    def _serve(self, request, sender):
        refuse_unsupported(request, UNSUPPORTED)
        stream = input_array(request, "stream")
        streaming = bool(stream is not None and np.asarray(stream).any())
        if streaming and not self.decoupled:
            raise RequestError("stream=true needs tensorrt_llm_bls's config.pbtxt to be decoupled")
        draft_n = input_array(request, "num_draft_tokens")
        if draft_n is not None:
            draft_n = int(np.asarray(draft_n).reshape(-1)[0])
            if draft_n > 0 and not self.draft:
                raise RequestError(
                    f"speculative decoding (num_draft_tokens={draft_n}) needs a draft model, and this repository has "
                    "none (tensorrt_llm_bls parameter tensorrt_llm_draft_model_name is not set); build the recipe "
                    "with engine.speculative.draft_recipe, or send num_draft_tokens=0"
                )
        else:
            draft_n = self.default_draft_tokens if self.draft else 0
        pre = self._preprocess(request)
        batch = pre["INPUT_ID"].shape[0]
        if draft_n > 0:
            if batch != 1:
                raise RequestError("speculative decoding serves one prompt per request (batch size 1)")
            self._speculative(request, sender, pre, draft_n, streaming)
            return
        tensors = self._llm_inputs(request, pre, streaming)
        if not streaming and batch > 1:  # each item answers on its own (batch_index), as the backend sends them
            for response in self._generate(self.llm, tensors):
                tokens, lengths = _output(response, "output_ids"), _output(response, "sequence_length")
                self._send(sender, self._response(self._postprocess(tokens, lengths), response), final=False)
            self._send(sender, None, final=True)
            return
        if not streaming:
            final = None
            for response in self._generate(self.llm, tensors):
                final = response
            if final is None:
                raise RequestError(f"{self.llm} sent no output")
            tokens, lengths = _output(final, "output_ids"), _output(final, "sequence_length")
            texts = self._postprocess(tokens, lengths)
            self._send(sender, self._response(texts, final), final=True)
            return
        beams = input_array(request, "beam_width")
        if beams is not None and int(np.asarray(beams).max()) > 1:
            raise RequestError("streaming with beam_width > 1 is not supported by tensorrt_llm_bls; send stream=false")
        self._stream(request, sender, tensors, batch)

    def _piece(self, text, sent, final):
        """(what to send, new sent count): the delta, or with accumulate_tokens the whole text so far."""
        delta, sent = text_delta(text, sent, final)
        return (text[:sent] if self.accumulate else delta), sent

    def _stream(self, request, sender, tensors, batch):
        acc = [[] for _ in range(batch)]
        sent = [0] * batch
        for response in self._generate(self.llm, tensors):
            if self._cancelled(request):
                self._send(sender, None, final=True)
                return
            tokens, lengths = _output(response, "output_ids"), _output(response, "sequence_length")
            items = _items(response, batch)
            for row, b in enumerate(items):
                acc[b].extend(int(t) for t in tokens[row, 0, : int(lengths[row, 0])])
            texts = self._accumulated_text(acc)
            pieces = []
            for b in items:
                piece, sent[b] = self._piece(texts[b], sent[b], final=False)
                pieces.append([piece])
            self._send(sender, self._response(pieces, response), final=False)
        texts = self._accumulated_text(acc)
        rest = [b for b in range(batch) if text_delta(texts[b], sent[b], final=True)[0]]
        if rest and batch > 1:  # characters held back at the end: each item's rest on its own, with its index
            for b in rest:
                piece = [[self._piece(texts[b], sent[b], final=True)[0]]]
                self._send(sender, self._response(piece, None, batch_index=b), final=False)
        elif rest:  # a character still held back (the output ended inside it): send what there is
            pieces = [[self._piece(texts[b], sent[b], final=True)[0]] for b in range(batch)]
            self._send(sender, self._response(pieces, None), final=True)
            return
        self._send(sender, None, final=True)

    def _accumulated_text(self, acc):
        width = max([len(a) for a in acc] + [1])
        tokens = np.zeros((len(acc), 1, width), dtype=np.int32)
        for b, a in enumerate(acc):
            tokens[b, 0, : len(a)] = a
        lengths = np.array([[len(a)] for a in acc], dtype=np.int32)
        return [row[0] for row in self._postprocess(tokens, lengths)]

    def _speculative(self, request, sender, pre, draft_n, streaming):
        prompt = [int(t) for t in pre["INPUT_ID"][0, : int(pre["REQUEST_INPUT_LEN"][0, 0])]]
        max_total = len(prompt) + int(pre["REQUEST_OUTPUT_LEN"].reshape(-1)[0])
        stop_words = stop_words_from_tensor(pre.get("STOP_WORDS_IDS"))
        base = self._llm_inputs(request, pre, streaming=False)
        base["exclude_input_in_output"] = np.array([[True]])
        use_logits = input_array(request, "use_draft_logits")
        use_logits = bool(use_logits is not None and np.asarray(use_logits).any())
        draft_base = dict(base)
        if use_logits:  # logit comparison: the draft returns its logits, the target gets them as draft_logits
            draft_base["return_generation_logits"] = np.array([[True]])
        ids, proposed, accepted, sent = list(prompt), 0, 0, 0
        rid = uuid.uuid4().hex[:8]
        while len(ids) < max_total:
            if self._cancelled(request):
                self._send(sender, None, final=True)
                return
            n = min(draft_n, max_total - len(ids) - 1)
            draft, logits = [], None
            if n > 0:
                outputs = ["output_ids", "sequence_length"] + (["generation_logits"] if use_logits else [])
                for response in self._generate(self.draft, self._with_ids(draft_base, ids, n), outputs):
                    out, length = _output(response, "output_ids"), _output(response, "sequence_length")
                    draft = [int(t) for t in out[0, 0, : int(length[0, 0])]]
                    logits = _output(response, "generation_logits")
            tensors = self._with_ids(base, ids, len(draft) + 1)
            if draft:
                tensors["draft_input_ids"] = np.array([draft], dtype=np.int32)
                if use_logits:
                    if logits is None:
                        raise RequestError(f"use_draft_logits: the draft model {self.draft} returned no generation logits")
                    tensors["draft_logits"] = np.ascontiguousarray(np.asarray(logits)[0, 0, -len(draft) :][None])
            new = []
            for response in self._generate(self.llm, tensors):
                out, length = _output(response, "output_ids"), _output(response, "sequence_length")
                new = [int(t) for t in out[0, 0, : int(length[0, 0])]]
            proposed += len(draft)
            accepted += accepted_prefix(new, draft)
            ids.extend(new)
            done = stopped_early(new, draft) or ends_with_stop_word(ids[len(prompt) :], stop_words)
            if streaming and new:
                text = self._accumulated_text([ids[len(prompt) :]])[0]
                piece, sent = self._piece(text, sent, final=done or len(ids) >= max_total)
                if piece:
                    self._send(sender, self._response([[piece]], None), final=False)
            if done:
                break
        rate = accepted / proposed if proposed else 0.0
        pb_utils.Logger.log_info(
            f"tensorrt_llm_bls [{rid}]: speculative decoding accepted {accepted}/{proposed} draft tokens ({rate:.0%})"
        )
        if streaming:
            self._send(sender, None, final=True)
            return
        exclude = input_array(request, "exclude_input_in_output")
        out = ids[len(prompt) :] if exclude is not None and np.asarray(exclude).any() else ids
        text = self._postprocess(np.array([[out or [0]]], dtype=np.int32), np.array([[len(out)]]))
        self._send(sender, self._response(text, None), final=True)

    @staticmethod
    def _with_ids(base, ids, out_len):
        tensors = dict(base)
        tensors["input_ids"] = np.array([ids], dtype=np.int32)
        tensors["input_lengths"] = np.array([[len(ids)]], dtype=np.int32)
        tensors["request_output_len"] = np.array([[out_len]], dtype=np.int32)
        return tensors

    @staticmethod
    def _stop(model, request_id, responses):
        """Stop a running request: the response iterator's cancel() where the stub has one (newer Triton),
        else upstream's way: a request to the same model with ``stop`` set and the same request id."""
        pb_utils.Logger.log_info(f"tensorrt_llm_bls: the client cancelled; stopping {model} request {request_id}")
        if hasattr(responses, "cancel"):
            responses.cancel()
            return
        stop = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=[
                pb_utils.Tensor("input_ids", np.zeros((1, 1), dtype=np.int32)),
                pb_utils.Tensor("input_lengths", np.ones((1, 1), dtype=np.int32)),
                pb_utils.Tensor("request_output_len", np.ones((1, 1), dtype=np.int32)),
                pb_utils.Tensor("stop", np.ones((1, 1), dtype=bool)),
            ],
            requested_output_names=[],
        )
        try:
            for response in stop.exec(decoupled=True):
                if response.has_error():
                    raise RuntimeError(response.error().message())
        except Exception as err:  # e.g. the model's config does not declare the `stop` input
            pb_utils.Logger.log_warn(f"tensorrt_llm_bls: could not stop {model} request {request_id}: {err}")

    # ------------------------------------------------------------------ responses
    def _response(self, texts, llm_response, batch_index=None):
        """text_output (flat: batch x beams strings, as upstream) + the declared outputs the model returned."""
        data = np.array([t.encode("utf-8") for row in texts for t in row], dtype=np.object_)
        tensors = [pb_utils.Tensor("text_output", data)]
        if batch_index is not None and "batch_index" in self.output_names:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[batch_index]], dtype=np.int32)))
        if llm_response is not None:
            for name in LLM_OUTPUTS[2:]:
                value = _output(llm_response, name) if name in self.output_names else None
                if value is not None:
                    tensors.append(pb_utils.Tensor(name, value))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def _cancelled(request):
        try:
            return bool(request.is_cancelled())
        except Exception:
            return False

    def _send(self, sender, response, final):
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        try:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)
        except Exception as err:
            pb_utils.Logger.log_warn(f"tensorrt_llm_bls: could not send a response: {err}")

    def _send_error(self, sender, message):
        response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
        self._send(sender, response, final=True)

    def finalize(self):
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=10)
        pb_utils.Logger.log_info("tensorrt_llm_bls: finalized")
