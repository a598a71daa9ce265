"""Triton Python model ``tensorrt_llm_bls``: preprocessing -> tensorrt_llm -> postprocessing in Python (BLS).

kiln copies this file into generated repositories as ``tensorrt_llm_bls/1/model.py``, with
``kiln_triton_utils.py`` beside it (the only other module it imports from kiln's source; it must not import
kiln). It takes the ensemble's inputs (``text_input``, ``max_tokens``, optional ``stream``, ``bad_words``,
``stop_words``, ``end_id``, ``pad_id``, ``top_k``, ``top_p``, ``temperature``, ``length_penalty``,
``repetition_penalty``, ``min_tokens``, ``presence_penalty``, ``frequency_penalty``, ``seed``,
``return_log_probs``, ``beam_width``, ``exclude_input_in_output``, ``num_draft_tokens``) and returns
``text_output`` (plus ``cum_log_probs``/``output_log_probs`` when declared and produced).

Each request runs in its own thread, so several requests are in the language model's running batch at
once (``execute`` returns at once; responses go through the request's response sender, which works with
and without a decoupled config). Streaming (``stream`` true) needs the BLS config to be decoupled.

Parameters: ``tensorrt_llm_model_name`` (default ``tensorrt_llm``), ``tensorrt_llm_draft_model_name``
(enables draft-target speculative decoding), ``num_draft_tokens`` (draft length when the request does not
send ``num_draft_tokens``; default 4), ``accumulate_tokens`` (streaming: decode all tokens so far each
time and send the new text, holding back an incomplete UTF-8 character: correct for every tokenizer;
default true), ``preprocessing_model_name`` / ``postprocessing_model_name`` (defaults as named).

Speculative decoding (batch size 1, as upstream): the draft model proposes up to N tokens for the text so
far (greedy or with the request's sampling settings); the target model gets them as ``draft_input_ids``
and returns the accepted ones plus one token of its own; repeat until ``max_tokens``, an end token or a
stop word. The acceptance rate is logged per request.

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
    text_delta,
)

#: BLS input -> preprocessing input.
PREPROC_INPUTS = {
    "text_input": "QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
}
#: preprocessing output -> tensorrt_llm input.
PREPROC_TO_LLM = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "BAD_WORDS_IDS": "bad_words_list",
    "STOP_WORDS_IDS": "stop_words_list",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
}
#: BLS input -> tensorrt_llm input (sent only when the client sent it).
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
    "exclude_input_in_output": "exclude_input_in_output",
}
PREPROC_OUTPUTS = list(PREPROC_TO_LLM)


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
        self.accumulate = get_bool_param(cfg, "accumulate_tokens", True)
        self.default_draft_tokens = get_int_param(cfg, "num_draft_tokens", 4)
        self.output_names = {out["name"] for out in cfg.get("output", [])}
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
        inputs = []
        for src, dst in PREPROC_INPUTS.items():
            value = input_array(request, src)
            if value is not None:
                if dst in ("REQUEST_OUTPUT_LEN", "END_ID", "PAD_ID"):
                    value = value.astype(np.int32)
                inputs.append(pb_utils.Tensor(dst, value))
        if input_array(request, "text_input") is None:
            raise RequestError("text_input is missing")
        if input_array(request, "max_tokens") is None:
            raise RequestError("max_tokens is missing")
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
                tensors[dst] = value
        tensors["streaming"] = np.full((tensors["input_ids"].shape[0], 1), streaming, dtype=bool)
        return tensors

    def _generate(self, model, tensors):
        """Yield the model's responses (one for a non-streaming request, several when streaming)."""
        request_id = f"kiln-bls-{uuid.uuid4().hex}"
        req = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=[pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in tensors.items()],
            requested_output_names=["output_ids", "sequence_length", "cum_log_probs", "output_log_probs"],
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
        req = pb_utils.InferenceRequest(
            model_name=self.postproc,
            inputs=[
                pb_utils.Tensor("TOKENS_BATCH", np.ascontiguousarray(tokens, dtype=np.int32)),
                pb_utils.Tensor("SEQUENCE_LENGTH", np.ascontiguousarray(lengths, dtype=np.int32)),
            ],
            requested_output_names=["OUTPUT"],
        )
        response = req.exec()
        _raise_if_error(response, "postprocessing")
        rows = _output(response, "OUTPUT")
        return [[t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in row] for row in rows]

    # ------------------------------------------------------------------ one request
    def _serve(self, request, sender):
        stream = input_array(request, "stream")
        streaming = bool(stream is not None and np.asarray(stream).any())
        if streaming and not self.decoupled:
            raise RequestError("stream=true needs tensorrt_llm_bls's config.pbtxt to be decoupled")
        pre = self._preprocess(request)
        batch = pre["INPUT_ID"].shape[0]
        draft_n = input_array(request, "num_draft_tokens")
        draft_n = self.default_draft_tokens if draft_n is None else int(np.asarray(draft_n).reshape(-1)[0])
        if self.draft and draft_n > 0:
            if batch != 1:
                raise RequestError("speculative decoding serves one prompt per request (batch size 1)")
            self._speculative(request, sender, pre, draft_n, streaming)
            return
        tensors = self._llm_inputs(request, pre, streaming)
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
        self._stream(request, sender, tensors, batch)

    def _stream(self, request, sender, tensors, batch):
        acc = [[] for _ in range(batch)]
        sent = [0] * batch
        for response in self._generate(self.llm, tensors):
            if self._cancelled(request):
                self._send(sender, None, final=True)
                return
            tokens, lengths = _output(response, "output_ids"), _output(response, "sequence_length")
            if not self.accumulate:
                texts = self._postprocess(tokens, lengths)
                self._send(sender, self._response(texts, response), final=False)
                continue
            for b in range(batch):
                acc[b].extend(int(t) for t in tokens[b, 0, : int(lengths[b, 0])])
            texts = self._accumulated_text(acc)
            deltas = []
            for b in range(batch):
                delta, sent[b] = text_delta(texts[b], sent[b], final=False)
                deltas.append([delta])
            if any(d[0] for d in deltas):
                self._send(sender, self._response(deltas, response), final=False)
        if self.accumulate:
            texts = self._accumulated_text(acc)
            deltas = [[text_delta(texts[b], sent[b], final=True)[0]] for b in range(batch)]
            if any(d[0] for d in deltas):
                self._send(sender, self._response(deltas, None), final=True)
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
        ids, proposed, accepted, sent = list(prompt), 0, 0, 0
        rid = uuid.uuid4().hex[:8]
        while len(ids) < max_total:
            if self._cancelled(request):
                self._send(sender, None, final=True)
                return
            n = min(draft_n, max_total - len(ids) - 1)
            draft = []
            if n > 0:
                for response in self._generate(self.draft, self._with_ids(base, ids, n)):
                    out, length = _output(response, "output_ids"), _output(response, "sequence_length")
                    draft = [int(t) for t in out[0, 0, : int(length[0, 0])]]
            tensors = self._with_ids(base, ids, len(draft) + 1)
            if draft:
                tensors["draft_input_ids"] = np.array([draft], dtype=np.int32)
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
                delta, sent = text_delta(text, sent, final=done or len(ids) >= max_total)
                if delta:
                    self._send(sender, self._response([[delta]], None), final=False)
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
    def _response(self, texts, llm_response):
        data = np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=np.object_)
        tensors = [pb_utils.Tensor("text_output", data)]
        if llm_response is not None:
            for name in ("cum_log_probs", "output_log_probs"):
                value = _output(llm_response, name)
                if value is not None and name in self.output_names:
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
