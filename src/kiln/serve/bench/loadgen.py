"""``kiln bench``'s load generator: virtual clients on gRPC streams, closed-loop (fixed concurrency) and open-loop
(request rate) levels, a liveness watchdog, and the wire protocol (requests built with tritonclient's generated
gRPC messages on a ``grpc.aio`` channel). See :mod:`kiln.serve.bench` for the whole picture."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kiln.serve.bench.config import COUNT_REQUEST_TENSOR, COUNT_TENSOR, BenchConfig, BenchError, Level, sampling_array
from kiln.serve.bench.report import BenchReport
from kiln.serve.bench.stats import LevelResult, Outcome, Recorder
from kiln.serve.wire import EMPTY_FINAL_PARAM, FINAL_PARAM, GRPC_OPTIONS, add_input, join_bytes_tensor

#: Liveness probe: per-probe timeout, watchdog period, and how long probes may fail before the bench gives up.
PROBE_TIMEOUT_S = 2.0
WATCHDOG_PERIOD_S = 1.0
DEAD_AFTER_S = 4.0
#: Pause before a client opens a new stream after its stream broke (the server was live).
STREAM_RETRY_S = 0.05


class _ServerGone(Exception):
    """Internal: the liveness probe says the server is gone; carries the reason."""


# ============================================================================================== wire protocol


@dataclass(frozen=True)
class _Contract:
    """What the bench learned about the model from the server: batching, optional inputs, decoupling."""

    batched: bool
    has_stream: bool
    has_counts: bool
    decoupled: bool | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _RequestFactory:
    """Builds ``ModelInferRequest`` messages: one template per prompt, copied with a fresh id per request."""

    def __init__(self, cfg: BenchConfig, contract: _Contract) -> None:
        import numpy as np
        from tritonclient.grpc import service_pb2

        self._pb = service_pb2
        self._np = np
        self.cfg = cfg
        self.contract = contract
        self._templates: dict[str, Any] = {}
        base = service_pb2.ModelInferRequest(model_name=cfg.model)
        base.parameters[EMPTY_FINAL_PARAM].bool_param = True
        self._add(base, cfg.max_tokens_tensor, np.array([cfg.output_len], dtype=np.int32), "INT32")
        if contract.has_stream:
            self._add(base, cfg.stream_tensor, np.array([cfg.streaming], dtype=bool), "BOOL")
        if contract.has_counts:
            self._add(base, COUNT_REQUEST_TENSOR, np.array([True], dtype=bool), "BOOL")
        for name, value in cfg.sampling.items():
            arr, dtype = sampling_array(name, value)
            self._add(base, name, arr, dtype)
        base.outputs.add().name = cfg.output_tensor
        if contract.has_counts:
            base.outputs.add().name = COUNT_TENSOR
        self._base = base

    def _add(self, req: Any, name: str, arr: Any, dtype: str) -> None:
        add_input(req, name, arr, dtype, self.contract.batched)

    def build(self, prompt: str, request_id: str) -> Any:
        template = self._templates.get(prompt)
        if template is None:
            template = self._pb.ModelInferRequest()
            template.CopyFrom(self._base)
            # The prompt goes first, as the contract lists it; order does not matter to Triton.
            self._add(template, self.cfg.input_tensor, self._np.array([prompt.encode("utf-8")], dtype=object), "BYTES")
            self._templates[prompt] = template
        req = self._pb.ModelInferRequest()
        req.CopyFrom(template)
        req.id = request_id
        return req


def _parse_response(resp: Any, output_name: str, want_counts: bool) -> tuple[bytes | None, int | None, bool]:
    """(text bytes or None when the response carries no text, token count or None, final flag)."""
    final = False
    param = resp.parameters.get(FINAL_PARAM)
    if param is not None:
        final = bool(param.bool_param)
    text: bytes | None = None
    count: int | None = None
    for i, out in enumerate(resp.outputs):
        if out.name == output_name:
            if i < len(resp.raw_output_contents):
                text = join_bytes_tensor(resp.raw_output_contents[i])
            else:  # typed contents (unusual for Triton's own server)
                text = b"".join(out.contents.bytes_contents)
        elif want_counts and out.name == COUNT_TENSOR:
            import numpy as np

            if i < len(resp.raw_output_contents):
                vals = np.frombuffer(resp.raw_output_contents[i], dtype=np.int32)
            else:
                vals = np.asarray(out.contents.int_contents, dtype=np.int32)
            count = int(vals.sum()) if vals.size else 0
    return text, count, final


# ============================================================================================== the client side


class _Health:
    """Liveness probes over the bench's channel; ``confirm`` dedupes concurrent probes."""

    def __init__(self, stub: Any) -> None:
        from tritonclient.grpc import service_pb2

        self._stub = stub
        self._req = service_pb2.ServerLiveRequest()
        self._lock = asyncio.Lock()
        self._last: tuple[float, str | None] | None = None

    async def probe(self) -> tuple[str | None, bool]:
        """(None, _) when live, else (reason, definite): definite when the server refused or is not live."""
        import grpc

        try:
            resp = await self._stub.ServerLive(self._req, timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            definite = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            return f"{exc.code().name}: {exc.details()}", definite
        except (asyncio.TimeoutError, OSError) as exc:  # pragma: no cover - grpc reports these as AioRpcError
            return f"{type(exc).__name__}: {exc}", False
        if not resp.live:
            return "the server reports it is not live (shutting down?)", True
        return None, False

    async def confirm(self) -> None:
        """Probe now (or reuse a probe from the last 0.25 s); raise :class:`_ServerGone` when definitely gone."""
        async with self._lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] > 0.25:
                reason, definite = await self.probe()
                self._last = (time.monotonic(), reason if definite else None)
            reason = self._last[1]
        if reason is not None:
            raise _ServerGone(reason)

    async def watch(self) -> None:
        """Probe every second; raise :class:`_ServerGone` once probes have failed for ``DEAD_AFTER_S``."""
        failing_since: float | None = None
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            started = time.monotonic()
            reason, definite = await self.probe()
            if reason is None:
                failing_since = None
                continue
            failing_since = failing_since if failing_since is not None else started
            if definite or time.monotonic() - failing_since >= DEAD_AFTER_S:
                raise _ServerGone(reason)


class _VirtualClient:
    """One gRPC stream, one request at a time on it; a broken or timed-out stream is replaced."""

    def __init__(self, session: _Session, name: str) -> None:
        self.session = session
        self.name = name
        self.seq = 0
        self._call: Any = None

    def reset(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            try:
                await asyncio.wait_for(call.done_writing(), timeout=1.0)
            except Exception:  # noqa: BLE001 - closing a stream that may already be broken
                pass
            call.cancel()

    async def request(self, prompt: str) -> Outcome:
        """Send one request and read its responses to the final one; failures are in the outcome, not raised."""
        import grpc

        s = self.session
        self.seq += 1
        rid = f"{self.name}-{self.seq}"
        req = s.factory.build(prompt, rid)
        o = Outcome(prompt=prompt, t_send=time.perf_counter(), t_end=0.0)
        try:
            await asyncio.wait_for(self._exchange(req, rid, o), timeout=s.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            self.reset()
            o.error_kind, o.error = "timeout", f"request {rid} not finished after {s.cfg.request_timeout_s:g}s"
        except grpc.aio.AioRpcError as exc:
            self.reset()
            o.error_kind, o.error = "stream", f"request {rid}: stream failed: {exc.code().name}: {exc.details()}"
        except (_StreamEnded, asyncio.InvalidStateError) as exc:  # the stream had ended before or during the request
            self.reset()
            o.error_kind, o.error = "stream", f"request {rid}: {exc or type(exc).__name__}"
        if not o.t_end:
            o.t_end = time.perf_counter()
        return o

    async def settle(self, o: Outcome) -> None:
        """After a broken stream: raise :class:`_ServerGone` if the server is gone, else pause before retrying."""
        if o.error_kind == "stream":
            await self.session.health.confirm()
            await asyncio.sleep(STREAM_RETRY_S)

    async def _exchange(self, req: Any, rid: str, o: Outcome) -> None:
        import grpc

        s = self.session
        if self._call is None:
            self._call = s.stub.ModelStreamInfer()
        call = self._call
        o.t_send = time.perf_counter()
        await call.write(req)
        chunks: list[bytes] = []
        while True:
            msg = await call.read()
            now = time.perf_counter()
            if msg is grpc.aio.EOF:
                raise _StreamEnded("the server closed the stream before the final response")
            resp = msg.infer_response
            if resp.id and resp.id != rid:
                continue  # a late response of an earlier request on this stream (after an error): not ours
            if msg.error_message:
                o.t_end = now
                o.error_kind, o.error = "model", f"request {rid}: {msg.error_message}"
                final = resp.parameters.get(FINAL_PARAM)
                if final is None or not final.bool_param:
                    self.reset()  # more may follow for this request: start afresh rather than misattribute
                return
            text, count, final = _parse_response(resp, s.cfg.output_tensor, s.contract.has_counts)
            if text is not None or count:
                if o.t_first is None:
                    o.t_first = now
                o.token_times.append(now)
                o.token_counts.append(count if count is not None else 1)
                if text is not None:
                    if s.cfg.cumulative_output:
                        chunks = [text]
                    else:
                        chunks.append(text)
            if final:
                o.t_end = now
                o.text = b"".join(chunks).decode("utf-8", errors="replace")
                return


class _StreamEnded(Exception):
    """The server ended a stream while a request was in flight."""


class _Session:
    """A channel, its stub, the model's contract and the request factory, shared by all levels of a run."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.channel: Any = None
        self.stub: Any = None
        self.health: _Health
        self.contract: _Contract
        self.factory: _RequestFactory
        self.prompts = cfg.prompt_list()

    async def open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.channel = grpc.aio.insecure_channel(
            self.cfg.url,
            options=GRPC_OPTIONS,
        )
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.health = _Health(self.stub)
        self.contract = await self._discover()
        self.factory = _RequestFactory(self.cfg, self.contract)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    async def _discover(self) -> _Contract:
        """Read the model's metadata and config; check the contract's tensors are there."""
        import grpc
        from tritonclient.grpc import service_pb2

        cfg = self.cfg
        try:
            meta = await self.stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=cfg.model), timeout=10)
            mcfg = (await self.stub.ModelConfig(service_pb2.ModelConfigRequest(name=cfg.model), timeout=10)).config
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BenchError(
                    f"cannot reach the Triton server at {cfg.url} ({exc.code().name}: {exc.details()}). "
                    "Start it (`kiln serve`) and pass its gRPC address as host:port."
                ) from exc
            raise BenchError(
                f"model {cfg.model!r} is not available on {cfg.url}: {exc.details()}. "
                "Check the model name (ensemble or tensorrt_llm_bls) and that it loaded."
            ) from exc
        inputs = tuple(t.name for t in meta.inputs)
        outputs = tuple(t.name for t in meta.outputs)
        missing = [n for n in (cfg.input_tensor, cfg.max_tokens_tensor) if n not in inputs]
        missing += [n for n in cfg.sampling if n not in inputs]
        if cfg.output_tensor not in outputs:
            missing.append(cfg.output_tensor)
        if missing:
            raise BenchError(
                f"model {cfg.model!r} does not have the tensors {missing} the bench needs "
                f"(it has inputs {list(inputs)}, outputs {list(outputs)}). Call the ensemble or the BLS model, "
                "or set the tensor names."
            )
        has_stream = cfg.stream_tensor in inputs
        if cfg.streaming and not has_stream:
            raise BenchError(
                f"model {cfg.model!r} has no {cfg.stream_tensor!r} input, so it cannot stream; "
                "run without streaming or call a model that can"
            )
        decoupled = bool(mcfg.model_transaction_policy.decoupled) if mcfg is not None else None
        return _Contract(
            batched=mcfg.max_batch_size > 0,
            has_stream=has_stream,
            has_counts=COUNT_REQUEST_TENSOR in inputs and COUNT_TENSOR in outputs,
            decoupled=decoupled,
            inputs=inputs,
            outputs=outputs,
        )

    def token_basis(self) -> str:
        if self.contract.has_counts:
            return "model"
        return "responses" if self.cfg.streaming else "unknown"

    def client(self, name: str) -> _VirtualClient:
        return _VirtualClient(self, name)

    def describe(self) -> dict[str, Any]:
        """What the report says about the model (after open)."""
        return {"name": self.cfg.model, **self.contract.to_dict(), "token_basis": self.token_basis()}


def make_session(cfg: BenchConfig) -> Any:
    """The session for ``cfg.api``: Triton gRPC streaming, or an OpenAI-compatible HTTP server."""
    if cfg.api == "openai":
        from kiln.serve.bench.openai_api import OpenAISession

        return OpenAISession(cfg)
    return _Session(cfg)


async def _closed_loop(session: _Session, level: Level, rec: Recorder, deadline: float) -> None:
    """``level.value`` clients, each sending its next request as soon as the previous one ends."""
    cfg = session.cfg
    counter = iter(range(cfg.max_requests if cfg.max_requests is not None else 2**62))
    prompts = session.prompts

    async def client(n: int) -> None:
        vc = session.client(f"{level.label}-{n}")
        try:
            while time.perf_counter() < deadline:
                idx = next(counter, None)
                if idx is None:
                    return
                rec.sent += 1
                outcome = await vc.request(prompts[idx % len(prompts)])
                rec.add(outcome)
                await vc.settle(outcome)
        finally:
            await vc.close()

    await _gather_or_fail([client(n) for n in range(int(level.value))])


async def _open_loop(session: _Session, level: Level, rec: Recorder, deadline: float) -> None:
    """Requests at ``level.value``/s (even or Poisson), each on a free stream of a bounded pool."""
    cfg = session.cfg
    rng = random.Random(cfg.seed)
    prompts = session.prompts
    pool: asyncio.Queue[_VirtualClient] = asyncio.Queue()
    made = 0
    inflight: set[asyncio.Task[None]] = set()
    failure: list[BaseException] = []

    async def run(vc: _VirtualClient, prompt: str) -> None:
        try:
            outcome = await vc.request(prompt)
            rec.add(outcome)
            await vc.settle(outcome)
        except Exception as exc:  # _ServerGone (or a bug): the dispatcher stops and raises it
            failure.append(exc)
        finally:
            pool.put_nowait(vc)

    t0 = time.perf_counter()
    next_at = t0
    n = 0
    try:
        while not failure:
            if cfg.max_requests is not None and n >= cfg.max_requests:
                break
            gap = rng.expovariate(level.value) if cfg.poisson else 1.0 / level.value
            if n:
                next_at += gap
            if next_at >= deadline:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if pool.empty() and made < cfg.max_outstanding:
                made += 1
                pool.put_nowait(session.client(f"{level.label}-{made}"))
            vc = await pool.get()
            rec.send_lag.append(max(0.0, time.perf_counter() - next_at) * 1e3)
            rec.sent += 1
            task = asyncio.ensure_future(run(vc, prompts[n % len(prompts)]))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            n += 1
        if inflight:
            await _gather_or_fail(list(inflight))
        if failure:
            raise failure[0]
    finally:
        for task in list(inflight):
            task.cancel()
        while not pool.empty():
            await pool.get_nowait().close()


async def _gather_or_fail(coros: Iterable[Any]) -> None:
    """Run all; on the first exception cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_level(session: _Session, level: Level) -> LevelResult:
    rec = Recorder(session.cfg, level, session.token_basis())
    rec.t_start = time.perf_counter()
    deadline = rec.t_start + session.cfg.duration_s
    body = _closed_loop if level.mode == "concurrency" else _open_loop
    work = asyncio.ensure_future(body(session, level, rec, deadline))
    watchdog = asyncio.ensure_future(session.health.watch())
    try:
        await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        for task in (watchdog, work):
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    except _ServerGone as exc:
        res = rec.result()
        raise BenchError(
            f"the server at {session.cfg.url} stopped answering during level {level.label} ({exc}); "
            f"{res.completed} requests had completed and {res.errors} failed in this level. "
            "Check the server log."
        ) from exc
    finally:
        for task in (work, watchdog):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watchdog, return_exceptions=True)
    return rec.result()


async def run_level(cfg: BenchConfig, level: Level | int | float) -> LevelResult:
    """Run one level on its own connection.

    ``level`` is a :class:`Level`, or a number: a request rate when ``cfg.rate`` is set, else a concurrency.

    Raises:
        BenchError: the server cannot be reached, lacks the model or its tensors, or died during the level.
    """
    if not isinstance(level, Level):
        level = Level("rate", float(level)) if cfg.rate is not None else Level("concurrency", float(int(level)))
    session = make_session(cfg)
    try:
        await session.open()
        return await _run_level(session, level)
    finally:
        await session.close()


async def run_bench_async(cfg: BenchConfig) -> BenchReport:
    """All of ``cfg``'s levels, in order, on one connection (see :func:`run_bench`)."""
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    session = make_session(cfg)
    results: list[LevelResult] = []
    opened = False

    def report() -> BenchReport:
        model = session.describe() if opened else {"name": cfg.model, "token_basis": None}
        # the model that ran (with --openai: the served id, not the Triton default the option starts from)
        return BenchReport({**cfg.to_dict(), "model": model["name"]}, model, list(results), started,
                           time.perf_counter() - t0)

    try:
        await session.open()
        opened = True
        for level in cfg.levels():
            results.append(await _run_level(session, level))
    except BenchError as exc:
        exc.report = report() if results else None
        raise
    finally:
        await session.close()
    return report()


def run_bench(cfg: BenchConfig) -> BenchReport:
    """Run every level of ``cfg`` and return the report (errors are in it, counted per level).

    Raises:
        BenchError: the server cannot be reached, lacks the model or its tensors, or died mid-run (then
            ``exc.report`` holds the levels that finished).
    """
    return asyncio.run(run_bench_async(cfg))
