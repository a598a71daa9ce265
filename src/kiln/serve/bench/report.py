"""``kiln bench``'s report: all levels of a run (:class:`BenchReport`) written as JSON, CSV and a plot, a text
table, and each level's figures against the planner's speed model (:func:`compare_with_plan`)."""

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
    lines.insert(0, f"model {report.model.get('name') or report.config.get('model')} at {report.config.get('url')}")
    lines.append(f"(latencies in ms; output tokens counted from: {', '.join(sorted(basis))})")
    for lv in report.levels:
        if lv.prompt_tokens is not None or lv.token_basis == "model":
            lines.append(f"{lv.label}: server-counted tokens: prompt {_fmt(lv.prompt_tokens, 0)}, completion "
                         f"{_fmt(lv.output_tokens, 0)} over {lv.completed} requests")
    for lv in report.levels:
        if lv.errors:
            kinds = ", ".join(f"{k}={v}" for k, v in sorted(lv.error_kinds.items()))
            lines.append(f"{lv.label}: {lv.errors} errors ({kinds})")
            lines.extend(f"    {msg}" for msg in lv.error_samples)
    return "\n".join(lines)


# ============================================================================================== planner figures


@dataclass(frozen=True)
class PlanComparison:
    """One measured figure next to the planner's prediction for it (``ratio`` = measured / predicted)."""

    level: str
    metric: str
    measured: float | None
    predicted: float
    ratio: float | None
    basis: str


def compare_with_plan(report: BenchReport, plan: Plan, isl: int | None = None) -> list[PlanComparison]:
    """Each fixed-concurrency level against the planner's speed model (:mod:`kiln.plan.speed`) for the same
    workload: TTFT p50, ITL p50 (against TPOT), E2E p50 and output tokens/s.

    The workload is ``isl`` prompt tokens (default: the run's synthetic prompt length in words, about one token
    per word for byte-level BPE vocabularies), ``output_len`` output tokens and the level's concurrency. Rate
    levels have no fixed concurrency and are left out; so is every level when the plan cannot predict the
    workload (the reason is in the one row returned with metric ``none``).
    """
    from kiln.plan import PlanError, SpeedModel, Workload
    from kiln.plan.result import ANCHOR_NOTE

    osl = int(report.config.get("output_len", 0) or 0)
    isl = isl or int(report.config.get("input_len", 0) or 0)
    basis = (f"kiln plan speed model for isl {isl}, osl {osl} at the level's concurrency ({ANCHOR_NOTE}); "
             "see the plan's `speed.basis`")
    rows: list[PlanComparison] = []
    try:
        model = SpeedModel(plan)
    except PlanError as exc:
        return [PlanComparison("-", "none", None, 0.0, None, f"no prediction: {exc}")]
    for lv in report.levels:
        if lv.mode != "concurrency" or lv.concurrency is None or not osl or not isl:
            continue
        try:
            wl, _ = model.predict(Workload(isl, osl, lv.concurrency))
        except PlanError as exc:
            return [PlanComparison("-", "none", None, 0.0, None, f"no prediction: {exc}")]
        pairs: list[tuple[str, float | None, float]] = [
            ("ttft_p50_ms", lv.ttft_p50_ms, wl.ttft_ms),
            ("itl_p50_ms", lv.itl_p50_ms, wl.tpot_ms),
            ("e2e_p50_ms", lv.e2e_p50_ms, wl.e2e_ms),
            ("output_tokens_per_s", lv.output_tokens_per_s, wl.output_tokens_per_s),
        ]
        for metric, measured, predicted in pairs:
            ratio = measured / predicted if measured is not None and predicted else None
            rows.append(PlanComparison(lv.label, metric, measured, predicted, ratio, basis))
    return rows


def format_comparison(rows: Sequence[PlanComparison]) -> str:
    """A plain-text table of :func:`compare_with_plan`'s rows (``x plan`` = measured / predicted)."""
    if not rows:
        return "(no fixed-concurrency level to compare with the plan)"
    if rows[0].metric == "none":
        return rows[0].basis
    lines = [f"{'level':>6}  {'metric':<20} {'measured':>10} {'vs plan':>10} {'x plan':>8}"]
    for r in rows:
        lines.append(f"{r.level:>6}  {r.metric:<20} {_fmt(r.measured, 2):>10} {r.predicted:>10.2f} "
                     f"{_fmt(r.ratio, 2):>8}")
    lines.append("plan: " + rows[0].basis)
    return "\n".join(lines)
