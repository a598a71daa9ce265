"""``kiln bench``'s statistics: each request's :class:`Outcome`, collected per level by a :class:`Recorder` into
a :class:`LevelResult` (TTFT, ITL and E2E percentiles, throughput, errors by kind). See :mod:`kiln.serve.bench`
for what is measured and how output tokens are counted."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.serve.bench.config import BenchConfig, Level

#: How many error messages a level keeps as samples.
ERROR_SAMPLES = 5


@dataclass
class LevelResult:
    """Figures for one level. Latencies in milliseconds; ``None`` where nothing was measured.

    ``errors`` counts every failed request, mismatches included (``error_kinds`` splits them: ``model``,
    ``timeout``, ``stream``, ``mismatch``). Token figures follow ``token_basis`` (see the module docstring).
    ``sent`` counts requests issued, ``completed`` those that ended well; ``responses`` the token-carrying
    responses received (final-only responses excluded). ``inconsistent`` counts completed requests whose
    text differs from the first text seen for the same prompt: not an error (sampling may be on), but with
    greedy decoding it should be 0. ``send_lag`` (rate levels): how late requests left against the schedule.
    """

    label: str
    mode: str
    concurrency: int | None
    rate: float | None
    duration_s: float
    sent: int
    completed: int
    errors: int
    mismatches: int
    error_kinds: dict[str, int]
    error_samples: list[str]
    token_basis: str
    output_tokens: int | None
    output_tokens_per_s: float | None
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    e2e_p99_ms: float | None
    e2e_mean_ms: float | None
    responses: int
    inconsistent: int
    send_lag_p50_ms: float | None = None
    send_lag_p99_ms: float | None = None
    outputs: dict[str, str] | None = None
    #: Prompt tokens of the completed requests as the server counted them (OpenAI ``usage.prompt_tokens``);
    #: None when the server reports no count.
    prompt_tokens: int | None = None

    #: Fields that are not one number (left out of the CSV).
    NON_SCALAR = ("error_kinds", "error_samples", "outputs")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        data = dataclasses.asdict(self)
        if data["outputs"] is None:
            del data["outputs"]
        return data

    def csv_row(self) -> dict[str, Any]:
        """Scalar figures for one CSV row (error kinds flattened as ``errors_<kind>``)."""
        row = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NON_SCALAR}
        for kind in ("model", "timeout", "stream", "mismatch"):
            row[f"errors_{kind}"] = self.error_kinds.get(kind, 0)
        return row


def _percentiles(samples: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    if not samples:
        return None, None, None
    import numpy as np

    p50, p90, p99 = np.percentile(np.asarray(samples, dtype=float), [50, 90, 99])
    return float(p50), float(p90), float(p99)


@dataclass
class Outcome:
    """One request, as the client saw it (times from ``time.perf_counter``)."""

    prompt: str
    t_send: float
    t_end: float
    t_first: float | None = None
    token_times: list[float] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's count (OpenAI usage.prompt_tokens), when it reports one
    text: str = ""
    error_kind: str | None = None
    error: str | None = None


class Recorder:
    """Collects outcomes of one level and turns them into a :class:`LevelResult`."""

    def __init__(self, cfg: BenchConfig, level: Level, token_basis: str) -> None:
        self.cfg = cfg
        self.level = level
        self.token_basis = token_basis
        self.sent = 0
        self.completed = 0
        self.responses = 0
        self.inconsistent = 0
        self.errors: Counter[str] = Counter()
        self.samples: list[str] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.send_lag: list[float] = []
        self.tokens = 0
        self.prompt_tokens: int | None = None
        self.first_text: dict[str, str] = {}
        self.t_start: float | None = None
        self.t_last: float | None = None

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.samples) < ERROR_SAMPLES:
            self.samples.append(f"[{kind}] {message}")

    def add(self, o: Outcome) -> None:
        self.t_last = o.t_end if self.t_last is None else max(self.t_last, o.t_end)
        self.responses += len(o.token_times)
        if o.error_kind is not None:
            self.error(o.error_kind, o.error or "")
            return
        expected = self.cfg.expected.get(o.prompt) if self.cfg.expected is not None else None
        if expected is not None and o.text != expected:
            self.error("mismatch", _mismatch_message(o.prompt, expected, o.text))
            return
        seen = self.first_text.setdefault(o.prompt, o.text)
        if seen != o.text:
            self.inconsistent += 1
        self.completed += 1
        if o.prompt_tokens is not None:
            self.prompt_tokens = (self.prompt_tokens or 0) + o.prompt_tokens
        self.e2e.append((o.t_end - o.t_send) * 1e3)
        if o.t_first is not None:
            self.ttft.append((o.t_first - o.t_send) * 1e3)
        for i in range(1, len(o.token_times)):
            gap = (o.token_times[i] - o.token_times[i - 1]) * 1e3
            count = o.token_counts[i] if i < len(o.token_counts) else 1
            self.itl.append(gap / max(count, 1))
        if self.token_basis == "model":
            self.tokens += sum(o.token_counts)
        elif self.token_basis == "responses":
            self.tokens += len(o.token_times)

    def result(self) -> LevelResult:
        start = self.t_start if self.t_start is not None else 0.0
        elapsed = max((self.t_last or start) - start, 1e-9) if self.t_last is not None else 0.0
        ttft, itl, e2e = _percentiles(self.ttft), _percentiles(self.itl), _percentiles(self.e2e)
        lag = _percentiles(self.send_lag) if self.level.mode == "rate" else (None, None, None)
        known_tokens = self.token_basis != "unknown"
        return LevelResult(
            label=self.level.label,
            mode=self.level.mode,
            concurrency=int(self.level.value) if self.level.mode == "concurrency" else None,
            rate=self.level.value if self.level.mode == "rate" else None,
            duration_s=elapsed,
            sent=self.sent,
            completed=self.completed,
            errors=sum(self.errors.values()),
            mismatches=self.errors.get("mismatch", 0),
            error_kinds=dict(self.errors),
            error_samples=list(self.samples),
            token_basis=self.token_basis,
            output_tokens=self.tokens if known_tokens else None,
            output_tokens_per_s=(self.tokens / elapsed if elapsed > 0 else 0.0) if known_tokens else None,
            requests_per_s=self.completed / elapsed if elapsed > 0 else 0.0,
            ttft_p50_ms=ttft[0],
            ttft_p90_ms=ttft[1],
            ttft_p99_ms=ttft[2],
            itl_p50_ms=itl[0] if known_tokens else None,
            itl_p90_ms=itl[1] if known_tokens else None,
            itl_p99_ms=itl[2] if known_tokens else None,
            e2e_p50_ms=e2e[0],
            e2e_p90_ms=e2e[1],
            e2e_p99_ms=e2e[2],
            e2e_mean_ms=sum(self.e2e) / len(self.e2e) if self.e2e else None,
            responses=self.responses,
            inconsistent=self.inconsistent,
            send_lag_p50_ms=lag[0],
            send_lag_p99_ms=lag[2],
            outputs=dict(self.first_text) if self.cfg.record_outputs else None,
            prompt_tokens=self.prompt_tokens,
        )


def _mismatch_message(prompt: str, expected: str, got: str) -> str:
    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), min(len(expected), len(got)))
    return (
        f"output differs from the expected text for prompt {prompt[:40]!r} at character {at}: "
        f"expected {expected[at : at + 30]!r}, got {got[at : at + 30]!r} "
        f"(lengths {len(expected)} vs {len(got)})"
    )
