"""The Triton side of kiln's OpenAI server: one ``grpc.aio`` channel, one bidirectional stream per request.

:class:`TritonBackend` learns the model's contract once (``ModelMetadata``/``ModelConfig``: which optional inputs
and outputs it has, whether it is decoupled and batched) and turns a :class:`~.protocol.GenerationRequest` into
an ensemble-contract request (``text_input``, ``max_tokens``, ``stream``, sampling, ``stop_words``, the
token-count and log-prob flags). :meth:`TritonBackend.generate` yields one :class:`Chunk` per response.

Streams are reused: a request takes an idle ``ModelStreamInfer`` stream from a pool (one request in flight per
stream, so every response is the request's own) and gives it back after its final response. Opening a stream
per request measured about 0.3 ms more CPU per request on the development machine.

Closing the generator early (the HTTP client went away, a stop sequence matched) stops the generation: it
cancels the gRPC call, which Triton passes to a Python model it calls directly (kiln's BLS then stops its
language-model request), but not to the steps of an ensemble (Triton 2.51: the ensemble stops scheduling new
steps, while the running ``tensorrt_llm`` request would generate to the end). So when the model is an ensemble
whose steps include a model with upstream's ``stop`` input, the backend also sends that model a ``stop`` request
with the same request id (the ensemble passes its id to its steps): upstream's own way of stopping a request,
which TensorRT-LLM's backend and kiln's reference runtime both honour.

Non-streaming requests with ``stop`` sequences or log-probabilities are streamed from Triton all the same (when
the model is decoupled): the app then cuts at the stop text and cancels the rest as soon as it appears, and each
response carries its own token, so per-token text and offsets equal a streamed request's.

Prompt scoring (``echo``, lm-eval's loglikelihood): :meth:`TritonBackend.score` sends the prompt's token ids to
the ensemble's language-model step with kiln's ``return_prompt_log_probs`` input; the model answers with each
prompt token's log-probability and the argmax alternative at every position (``prompt_log_probs``,
``prompt_top_ids``, ``prompt_top_log_probs``), computed where the logits are: never the context logits over
the wire. kiln's reference runtime has these tensors. A TensorRT engine (upstream's ``tensorrt_llm`` model) has
no such outputs; it returns the prompt's whole ``context_logits`` (FP32 [1, n, vocab]: a 2k-token prompt with a
128k vocabulary is 1 GiB) when its engine was built with ``--gather_context_logits`` (the recipe's
``engine.gather_context_logits``). The backend then asks that step for them over the local gRPC channel and
reduces them here, in the server, to the same 3 × n numbers (:func:`score_from_logits`): the logits never reach
the HTTP client. An engine built without them is refused with the recipe key that builds it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kiln.serve.openai.protocol import APIError, GenerationRequest, bad
from kiln.serve.wire import (
    EMPTY_FINAL_PARAM,
    GRPC_OPTIONS,
    add_scalar_input,
    is_final,
    output_bytes,
    raw_fp32_list,
    raw_int32_sum,
)

#: Ensemble inputs the server sends: name -> Triton datatype.
INPUT_TYPES = {"text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "exclude_input_in_output": "BOOL", "temperature": "FP32", "top_p": "FP32",
               "top_k": "INT32", "seed": "UINT64", "stop_words": "BYTES", "return_log_probs": "BOOL",
               "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL", "end_id": "INT32",
               "min_tokens": "INT32"}
#: kiln's prompt-scoring extension of the tensorrt_llm contract (see the module docstring).
SCORE_INPUT = "return_prompt_log_probs"
SCORE_OUTPUTS = ("prompt_log_probs", "prompt_top_ids", "prompt_top_log_probs")
#: upstream's context-logits switch and output on the tensorrt_llm model (TensorRT engine target).
LOGITS_INPUT, LOGITS_OUTPUT = "return_context_logits", "context_logits"
#: What a prompt-scoring request on an engine without context logits is told to do.
GATHER_KEY = "engine.gather_context_logits"


#: Idle streams kept open for reuse (beyond this, a finished request's stream is closed).
MAX_IDLE_STREAMS = 256


@dataclass(frozen=True)
class Contract:
    """What the Triton model has (names of its inputs and outputs), and how it is configured."""

    inputs: frozenset[str]
    outputs: frozenset[str]
    decoupled: bool
    batched: bool
    stop_model: str | None = None  # an ensemble step with upstream's `stop` input (see the module docstring)
    score_model: str | None = None  # the model that scores prompts (kiln's return_prompt_log_probs input)
    logits_model: str | None = None  # the step that returns context logits (upstream's tensorrt_llm model)

    def counts(self, kind: str) -> bool:
        """Whether the model reports ``num_<kind>_tokens`` (kind: input or output) when asked."""
        return f"return_num_{kind}_tokens" in self.inputs and f"num_{kind}_tokens" in self.outputs

    @property
    def logprobs(self) -> bool:
        return "return_log_probs" in self.inputs and "output_log_probs" in self.outputs


@dataclass
class Chunk:
    """One Triton response: its text, token counts (None: not reported), the chosen tokens' log-probs."""

    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    logprobs: list[float] = field(default_factory=list)
    final: bool = False


@dataclass
class Score:
    """A prompt scored by the model: per position j, the log-prob of token j given tokens < j (entry 0: none),
    and the argmax token of the distribution predicting position j with its log-prob (entry n: the next token)."""

    log_probs: list[float]
    top_ids: list[int]
    top_log_probs: list[float]


def score_from_logits(logits: Any, ids: list[int], block: int = 64) -> Score:
    """A :class:`Score` from a prompt's context logits (row j: the logits after token j, as TensorRT-LLM's
    ``context_logits`` and a forward pass give them), flat or [.., n, vocab]. Computed in float64, ``block`` rows
    at a time (64 rows of a 128k vocabulary: 64 MiB), so the whole prompt is never copied."""
    import numpy as np

    n = len(ids)
    rows = np.asarray(logits).reshape(n, -1)  # a view of the received buffer
    targets = np.asarray([*ids[1:], 0], dtype=np.int64)  # row j scores token j+1 (the last row: only its argmax)
    chosen, top, top_lp = [], [], []
    for start in range(0, n, block):
        b = rows[start:start + block].astype(np.float64)
        shifted = b - b.max(axis=-1, keepdims=True)
        lp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # log-softmax over the vocabulary
        arg = lp.argmax(axis=-1)
        at = np.arange(len(b))
        chosen += lp[at, targets[start:start + block]].tolist()
        top += arg.tolist()
        top_lp += lp[at, arg].tolist()
    return Score([0.0, *chosen[:n - 1]], [-1, *top], [0.0, *top_lp])


class TritonBackend:
    """A Triton model behind the ensemble's contract, reached over gRPC (``host:port``)."""

    def __init__(self, url: str, model: str = "ensemble") -> None:
        self.url = url
        self.model = model
        self._channel: Any = None
        self._stub: Any = None
        self._contract: Contract | None = None
        self._lock = asyncio.Lock()
        self._stops: set[asyncio.Task[None]] = set()
        self._idle: list[Any] = []  # open ModelStreamInfer calls with no request in flight

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self.url, options=GRPC_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def ready(self) -> bool:
        """Whether the model is loaded and ready (False when Triton is unreachable)."""
        import grpc
        from tritonclient.grpc import service_pb2

        try:
            resp = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=2)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.ready)

    async def contract(self) -> Contract:
        """The model's contract, read once (raises APIError 503 while Triton or the model is not up)."""
        if self._contract is not None:
            return self._contract
        import grpc
        from tritonclient.grpc import service_pb2

        async with self._lock:
            if self._contract is None:
                try:
                    meta = await self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=self.model), timeout=5)
                    cfg = (await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=self.model),
                                                        timeout=5)).config
                except grpc.aio.AioRpcError as exc:
                    raise APIError(503, f"the Triton model {self.model!r} at {self.url} is not available "
                                        f"({exc.code().name}: {exc.details()})") from None
                names = {t.name for t in meta.inputs}
                missing = {"text_input", "max_tokens"} - names
                if missing or "text_output" not in {t.name for t in meta.outputs}:
                    raise APIError(500, f"the Triton model {self.model!r} does not have the ensemble's contract "
                                        "(text_input, max_tokens -> text_output)")
                self._contract = Contract(frozenset(names), frozenset(t.name for t in meta.outputs),
                                          bool(cfg.model_transaction_policy.decoupled), cfg.max_batch_size > 0,
                                          await self._step_with(cfg, "stop"),
                                          await self._step_with(cfg, SCORE_INPUT, set(SCORE_OUTPUTS)),
                                          await self._step_with(cfg, LOGITS_INPUT, {LOGITS_OUTPUT}))
        return self._contract

    async def _step_with(self, cfg: Any, input_name: str, outputs: set[str] = frozenset()) -> str | None:
        """The first step of an ensemble that takes ``input_name`` (and has ``outputs``); None for other models."""
        import grpc
        from tritonclient.grpc import service_pb2

        if cfg.platform != "ensemble":
            return None
        for step in cfg.ensemble_scheduling.step:
            try:
                meta = await self._stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=step.model_name), timeout=5)
            except grpc.aio.AioRpcError:
                continue
            if input_name in {t.name for t in meta.inputs} and outputs <= {t.name for t in meta.outputs}:
                return step.model_name
        return None

    async def score(self, ids: list[int], context_logits: bool | None = None) -> Score:
        """The model's log-probabilities of the prompt ``ids`` and its argmax alternatives (see :class:`Score`).

        ``context_logits``: whether the served engine keeps prompt logits (the repository's kiln.json says, from
        ``engine.gather_context_logits``); None when unknown (no repository), and then the engine is asked."""
        import struct

        import grpc
        from tritonclient.grpc import service_pb2

        c = await self.contract()
        model, switch, outputs = c.score_model, SCORE_INPUT, SCORE_OUTPUTS
        if model is None and c.logits_model is not None:
            if context_logits is False:
                raise bad("echo (prompt log-probabilities) needs the prompt's logits, and the served TensorRT engine "
                          f"was built without them: rebuild it with --set {GATHER_KEY}=true (it costs a "
                          "prompt x vocabulary FP32 buffer per request in the context phase)", "echo",
                          code="gather_context_logits_off")
            model, switch, outputs = c.logits_model, LOGITS_INPUT, (LOGITS_OUTPUT,)
        if model is None:
            raise bad(f"echo (prompt log-probabilities): the Triton model {self.model!r} does not compute them: it "
                      "has no step with kiln's return_prompt_log_probs input (the reference runtime) or upstream's "
                      f"context_logits output (a TensorRT engine built with {GATHER_KEY})", "echo")
        msg = service_pb2.ModelInferRequest(model_name=model, id=f"kiln-openai-score-{uuid.uuid4().hex}")
        msg.parameters[EMPTY_FINAL_PARAM].bool_param = True
        msg.inputs.add(name="input_ids", datatype="INT32", shape=[1, len(ids)] if c.batched else [len(ids)])
        msg.raw_input_contents.append(struct.pack(f"<{len(ids)}i", *ids))
        for name, value, dtype in (("input_lengths", len(ids), "INT32"), ("request_output_len", 1, "INT32"),
                                   (switch, True, "BOOL")):
            add_scalar_input(msg, name, value, dtype, c.batched)
        for name in outputs:
            msg.outputs.add().name = name
        call = self._stub.ModelStreamInfer()
        values: dict[str, list] = {}
        try:
            await call.write(msg)
            while not values:
                item = await call.read()
                if item is grpc.aio.EOF:
                    raise APIError(503, f"Triton at {self.url} closed the stream before the scores")
                if item.error_message:
                    raise APIError(400, item.error_message)
                resp = item.infer_response
                for i, out in enumerate(resp.outputs):
                    if out.name == LOGITS_OUTPUT and LOGITS_OUTPUT in outputs:  # [1, n, vocab] FP32, reduced here
                        import numpy as np

                        dtype = {"FP32": "<f4", "FP16": "<f2", "BF16": None}.get(out.datatype)
                        if dtype is None or i >= len(resp.raw_output_contents):
                            raise APIError(500, f"{model}: context_logits came as {out.datatype}; kiln builds "
                                                "engines with --logits_dtype float32")
                        return score_from_logits(np.frombuffer(resp.raw_output_contents[i], dtype=dtype), ids)
                    if out.name == "prompt_top_ids":
                        raw = resp.raw_output_contents[i]
                        values[out.name] = [v for (v,) in struct.iter_unpack("<i", raw)]
                    elif out.name in SCORE_OUTPUTS:
                        values[out.name] = raw_fp32_list(resp, i)
                if not values and is_final(resp):
                    raise APIError(500, f"the Triton model {c.score_model!r} sent no prompt log-probabilities")
        except grpc.aio.AioRpcError as exc:
            raise APIError(503, f"Triton at {self.url}: {exc.code().name}: {exc.details()}") from None
        finally:
            call.cancel()
        return Score(values["prompt_log_probs"], values["prompt_top_ids"], values["prompt_top_log_probs"])

    def _send_stop(self, model: str, request_id: str, batched: bool) -> None:
        """Fire a ``stop`` request for ``request_id`` at ``model`` (in the background; failures are ignored)."""
        from tritonclient.grpc import service_pb2

        msg = service_pb2.ModelInferRequest(model_name=model, id=request_id)
        msg.parameters[EMPTY_FINAL_PARAM].bool_param = True
        for name, value, dtype in (("input_ids", 0, "INT32"), ("input_lengths", 1, "INT32"),
                                   ("request_output_len", 1, "INT32"), ("stop", True, "BOOL")):
            add_scalar_input(msg, name, value, dtype, batched)

        async def send() -> None:
            import grpc

            call = self._stub.ModelStreamInfer()
            try:
                await call.write(msg)
                await asyncio.wait_for(call.read(), timeout=10)
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                pass
            finally:
                call.cancel()

        task = asyncio.ensure_future(send())
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)

    def _request(self, req: GenerationRequest, prompt: str, max_tokens: int, c: Contract) -> Any:
        from tritonclient.grpc import service_pb2

        msg = service_pb2.ModelInferRequest(model_name=self.model, id=f"kiln-openai-{uuid.uuid4().hex}")
        msg.parameters[EMPTY_FINAL_PARAM].bool_param = True
        wanted: dict[str, Any] = {"text_input": prompt.encode("utf-8"), "max_tokens": max_tokens,
                                  # stop sequences and per-token log-probs: streamed internally (module docstring)
                                  "stream": (req.stream or bool(req.stop) or req.logprobs) and c.decoupled,
                                  "exclude_input_in_output": True}
        if req.greedy:  # greedy on every target (TensorRT-LLM samples only with top_k > 1 or top_p > 0); a model
            # without sampling inputs (kiln bench's mock) cannot sample anyway
            if "top_k" in c.inputs:
                wanted["top_k"] = 1
            elif "temperature" in c.inputs:
                wanted["temperature"] = 0.0
        else:
            wanted.update(temperature=req.temperature, top_p=req.top_p)
        if req.seed is not None:
            wanted["seed"] = req.seed
        if req.stop:
            wanted["stop_words"] = [w.encode("utf-8") for w in req.stop]  # Triton stops early; the app cuts the text
        if req.ignore_eos:  # end_id -1: no token ends the generation
            if "end_id" not in c.inputs:
                raise bad(f"ignore_eos: the Triton model {self.model!r} has no end_id input to turn the end token "
                          "off with", "ignore_eos")
            wanted["end_id"] = -1
        if req.min_tokens:
            wanted["min_tokens"] = req.min_tokens
        if req.logprobs:
            if not c.logprobs:
                raise bad(f"logprobs: the Triton model {self.model!r} does not return log-probabilities", "logprobs")
            wanted["return_log_probs"] = True
        for kind in ("input", "output"):
            if c.counts(kind):
                wanted[f"return_num_{kind}_tokens"] = True
        for name, value in wanted.items():
            if name not in c.inputs and name not in ("text_input", "max_tokens"):
                if name in req.explicit:
                    raise bad(f"{name}: the Triton model {self.model!r} has no such input", name)
                continue  # a default the model does not take
            add_scalar_input(msg, name, value, INPUT_TYPES[name], c.batched)
        outputs = ["text_output"]
        if req.logprobs:
            outputs.append("output_log_probs")
        outputs += [f"num_{kind}_tokens" for kind in ("input", "output") if c.counts(kind)]
        for name in outputs:
            msg.outputs.add().name = name
        return msg

    async def generate(self, req: GenerationRequest, prompt: str, max_tokens: int) -> AsyncIterator[Chunk]:
        """Send one request; yield a Chunk per response. Model errors raise APIError(400, the model's message)."""
        import grpc

        c = await self.contract()
        msg = self._request(req, prompt, max_tokens, c)
        pooled = bool(self._idle)
        call = self._idle.pop() if pooled else self._stub.ModelStreamInfer()
        done = False
        try:
            try:
                await call.write(msg)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                if not pooled:
                    raise
                call.cancel()  # an idle stream that broke meanwhile (Triton restarted): one more try, on a new one
                call = self._stub.ModelStreamInfer()
                await call.write(msg)
            while True:
                item = await call.read()
                if item is grpc.aio.EOF:
                    raise APIError(503, f"Triton at {self.url} closed the stream before the final response")
                resp = item.infer_response
                if resp.id and resp.id != msg.id:
                    continue  # not this request's (a stream is only reused after its request's final response)
                if item.error_message:
                    final = is_final(resp)
                    done = final  # a final error leaves the stream reusable; otherwise it is dropped
                    raise APIError(400, item.error_message)
                chunk = Chunk(final=is_final(resp))
                for i, out in enumerate(resp.outputs):
                    if out.name == "text_output":
                        chunk.text = output_bytes(resp, i).decode("utf-8", errors="replace")
                    elif out.name == "num_input_tokens":
                        chunk.input_tokens = raw_int32_sum(resp, i)
                    elif out.name == "num_output_tokens":
                        chunk.output_tokens = raw_int32_sum(resp, i)
                    elif out.name == "output_log_probs":
                        chunk.logprobs = raw_fp32_list(resp, i)
                done = chunk.final
                if done and len(self._idle) < MAX_IDLE_STREAMS:
                    self._idle.append(call)
                    call = None
                yield chunk
                if done:
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise APIError(503, f"Triton at {self.url} is not reachable ({exc.code().name})") from None
            raise APIError(500, f"Triton stream failed: {exc.code().name}: {exc.details()}") from None
        finally:
            if not done:  # the caller stopped early (client gone, stop sequence) or an error: stop it in Triton
                call.cancel()
                if c.stop_model is not None:
                    self._send_stop(c.stop_model, msg.id, c.batched)
            elif call is not None:
                if len(self._idle) < MAX_IDLE_STREAMS:
                    self._idle.append(call)
                else:
                    call.cancel()
