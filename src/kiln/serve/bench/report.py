"""``kiln bench``'s report: all levels of a run (:class:`BenchReport`) written as JSON, CSV and a plot, a text
table, and each level's figures against the planner's roofline ideal (:func:`compare_with_plan`)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.serve.bench.stats import LevelResult

if TYPE_CHECKING:  # pragma: no cover - typing only
    from kiln.plan import Plan

@dataclass
class BenchReport:
    """All levels of one run, with the settings and what was learned about the model's contract."""

    config: dict[str, Any]
    model: dict[str, Any]
    levels: list[LevelResult]
    started_at: str
    wall_s: float

    @property
    def total_errors(self) -> int:
        """Errors over all levels (mismatches included): a run with any is not a clean run."""
        return sum(level.errors for level in self.levels)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready content."""
        return {
            "kiln_bench_version": 1,
            "started_at": self.started_at,
            "wall_s": self.wall_s,
            "config": self.config,
            "model": self.model,
            "total_errors": self.total_errors,
            "levels": [level.to_dict() for level in self.levels],
        }

    def to_json(self) -> str:
        """The report as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def to_csv(self) -> str:
        """One row per level, scalar figures only."""
        rows = [level.csv_row() for level in self.levels]
        buf = io.StringIO()
        if rows:
            writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return buf.getvalue()

    def write(self, out_dir: Path, stem: str = "bench") -> dict[str, Path]:
        """Write ``<stem>.json``, ``<stem>.csv`` and ``<stem>.png`` into ``out_dir``; returns their paths."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"json": out_dir / f"{stem}.json", "csv": out_dir / f"{stem}.csv", "png": out_dir / f"{stem}.png"}
        paths["json"].write_text(self.to_json() + "\n", encoding="utf-8")
        paths["csv"].write_text(self.to_csv(), encoding="utf-8")
        plot_report(self, paths["png"])
        return paths


def plot_report(report: BenchReport, path: Path) -> None:
    """Throughput against latency across levels, one labelled point per level (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = report.levels
    title = f"kiln bench: {report.config.get('model')} @ {report.config.get('url')}"
    fig.suptitle(title)
    _plot_pairs(
        left, levels, "output_tokens_per_s", "output tokens/s", [("e2e_p50_ms", "E2E p50"), ("itl_p50_ms", "ITL p50")]
    )
    _plot_pairs(
        right, levels, "requests_per_s", "requests/s", [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")]
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_pairs(
    ax: Any, levels: Sequence[LevelResult], x_key: str, x_label: str, series: list[tuple[str, str]]
) -> None:
    plotted = False
    for key, name in series:
        pts = [
            (getattr(lv, x_key), getattr(lv, key), lv.label)
            for lv in levels
            if getattr(lv, x_key) is not None and getattr(lv, key) is not None and getattr(lv, key) > 0
        ]
        if not pts:
            continue
        plotted = True
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, y, label in pts:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(x_label)
    ax.set_ylabel("latency (ms, log scale)" if plotted else "latency (ms)")
    if plotted:
        ax.set_yscale("log")  # TTFT/E2E and ITL differ by orders of magnitude
    ax.grid(True, alpha=0.3)
    if plotted:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: BenchReport) -> str:
    """A plain-text table of the report (one row per level) followed by error samples, if any."""
    head = (
        "level",
        "req/s",
        "tok/s",
        "ttft p50",
        "ttft p99",
        "itl p50",
        "itl p99",
        "e2e p50",
        "e2e p99",
        "done",
        "errors",
    )
    rows = [head]
    for lv in report.levels:
        rows.append(
            (
                lv.label,
                _fmt(lv.requests_per_s),
                _fmt(lv.output_tokens_per_s),
                _fmt(lv.ttft_p50_ms),
                _fmt(lv.ttft_p99_ms),
                _fmt(lv.itl_p50_ms, 2),
                _fmt(lv.itl_p99_ms, 2),
                _fmt(lv.e2e_p50_ms),
                _fmt(lv.e2e_p99_ms),
                str(lv.completed),
                str(lv.errors),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    basis = {lv.token_basis for lv in report.levels}
    lines.append(f"(latencies in ms; output tokens counted from: {', '.join(sorted(basis))})")
    for lv in report.levels:
        if lv.errors:
            kinds = ", ".join(f"{k}={v}" for k, v in sorted(lv.error_kinds.items()))
            lines.append(f"{lv.label}: {lv.errors} errors ({kinds})")
            lines.extend(f"    {msg}" for msg in lv.error_samples)
    return "\n".join(lines)


# ============================================================================================== planner ideal


@dataclass(frozen=True)
class IdealComparison:
    """One measured figure next to the planner's ideal for it (``ratio`` = measured / ideal)."""

    level: str
    metric: str
    measured: float | None
    ideal: float
    ratio: float | None
    basis: str


def _decode_step(plan: Plan, batch: int) -> tuple[float, float] | None:
    """(step_ms, tokens/s) at ``batch``: the planner's point or a linear interpolation; None outside its range."""
    points = sorted(plan.limits.decode, key=lambda p: p.batch)
    for p in points:
        if p.batch == batch:
            return p.step_ms, p.tokens_per_s
    for lo, hi in zip(points, points[1:], strict=False):
        if lo.batch < batch < hi.batch:
            frac = (batch - lo.batch) / (hi.batch - lo.batch)
            step = lo.step_ms + frac * (hi.step_ms - lo.step_ms)
            return step, batch / (step / 1e3)
    return None


def compare_with_plan(report: BenchReport, plan: Plan) -> list[IdealComparison]:
    """Each level's figures against the planner's roofline ideal, where the planner has one.

    Fixed-concurrency levels only (a rate level has no fixed batch). Compared: ITL p50 against the decode step
    time at batch = concurrency, output tokens/s against the decode throughput at that batch, and E2E p50
    against ``output_len`` decode steps (prefill left out, so a lower bound). The planner's decode figures
    assume every sequence at ``max_seq_len`` (worst case) and ignore overheads: see ``plan.limits.decode_basis``.
    Levels whose concurrency exceeds what the plan can batch have no ideal.
    """
    out_len = int(report.config.get("output_len", 0) or 0)
    basis = "planner decode roofline at batch = concurrency (" + plan.limits.decode_basis + ")"
    rows: list[IdealComparison] = []
    for lv in report.levels:
        if lv.mode != "concurrency" or lv.concurrency is None:
            continue
        point = _decode_step(plan, lv.concurrency)
        if point is None:
            continue
        step_ms, tok_s = point
        pairs: list[tuple[str, float | None, float]] = [
            ("itl_p50_ms", lv.itl_p50_ms, step_ms),
            ("output_tokens_per_s", lv.output_tokens_per_s, tok_s),
        ]
        if out_len:
            pairs.append(("e2e_p50_ms", lv.e2e_p50_ms, out_len * step_ms))
        for metric, measured, ideal in pairs:
            ratio = measured / ideal if measured is not None and ideal else None
            rows.append(IdealComparison(lv.label, metric, measured, ideal, ratio, basis))
    return rows


def format_comparison(rows: Sequence[IdealComparison]) -> str:
    """A plain-text table of :func:`compare_with_plan`'s rows (``x ideal`` = measured / ideal)."""
    if not rows:
        return "(the planner has no ideal for these levels)"
    lines = [f"{'level':>6}  {'metric':<20} {'measured':>10} {'ideal':>10} {'x ideal':>8}"]
    for r in rows:
        lines.append(f"{r.level:>6}  {r.metric:<20} {_fmt(r.measured, 2):>10} {r.ideal:>10.2f} {_fmt(r.ratio, 2):>8}")
    lines.append("ideal: " + rows[0].basis)
    return "\n".join(lines)
