"""``kiln plan --compare``: one workload on several recipes or GPUs, side by side, as JSON and a plot.

Each entry is a plan with its predicted speed for the workload, and a curve of the same prediction at
concurrency 1, 2, 4, … up to the largest batch its limits allow: tokens/s per GPU against TTFT, the trade-off
behind "tp 2 or tp 4, fp8 or int4".
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kiln.plan.errors import PlanError
from kiln.plan.result import ANCHOR_NOTE, Plan, WorkloadPlan
from kiln.plan.speed import SpeedModel, Workload

__all__ = ["CompareEntry", "compare_entry", "compare_json", "plot_compare", "render_compare", "write_compare"]


@dataclass
class CompareEntry:
    """One recipe on one GPU: its plan, the workload's prediction (None when the plan does not fit or the
    workload cannot run, with ``reason``) and the concurrency curve."""

    label: str
    recipe: str
    plan: Plan
    workload: WorkloadPlan | None
    curve: list[WorkloadPlan] = field(default_factory=list)
    reason: str | None = None


def _levels(most: int) -> list[int]:
    levels, c = [], 1
    while c < most:
        levels.append(c)
        c *= 2
    return [*levels, most]


def compare_entry(label: str, recipe: str, plan: Plan, workload: Workload) -> CompareEntry:
    """``plan``'s prediction for ``workload`` and its concurrency curve; None with the reason when the plan
    does not fit or the engine would refuse the workload (a prompt longer than max_input_len, …)."""
    if not plan.fits:
        return CompareEntry(label, recipe, plan, None, reason=plan.verdict)
    try:
        model = SpeedModel(plan)
        predicted, _ = model.predict(workload)
        most = min(model.limits(workload).values())
        curve = [model.predict(Workload(workload.isl, workload.osl, c))[0] for c in _levels(most)]
    except PlanError as exc:
        return CompareEntry(label, recipe, plan, None, reason=str(exc))
    return CompareEntry(label, recipe, plan, predicted, curve)


def compare_json(entries: list[CompareEntry], workload: Workload) -> dict[str, Any]:
    """JSON-ready content: the workload, and per entry its setup, verdict, prediction and curve."""
    return {
        "workload": dataclasses.asdict(workload),
        "anchors": ANCHOR_NOTE,
        "entries": [
            {
                "label": e.label,
                "recipe": e.recipe,
                "gpu": e.plan.gpu["name"],
                "tp": e.plan.tp,
                "pp": e.plan.pp,
                "format": e.plan.weights.format,
                "kv_cache": e.plan.kv_cache.dtype,
                "fits": e.plan.fits,
                "verdict": e.plan.verdict,
                "workload": dataclasses.asdict(e.workload) if e.workload else None,
                "reason": e.reason,
                "curve": [dataclasses.asdict(w) for w in e.curve],
            }
            for e in entries
        ],
    }


def plot_compare(entries: list[CompareEntry], workload: Workload, path: Path) -> None:
    """Tokens/s per GPU against TTFT: one curve per entry over concurrency, its workload point marked."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for e in entries:
        if not e.curve or e.workload is None:
            continue
        (line,) = ax.plot([w.ttft_ms for w in e.curve], [w.output_tokens_per_s_per_gpu for w in e.curve],
                          marker=".", label=e.label)
        ax.plot([e.workload.ttft_ms], [e.workload.output_tokens_per_s_per_gpu], marker="o", markersize=10,
                color=line.get_color(), markerfacecolor="none")
        ax.annotate(f"batch {e.workload.batch}", (e.workload.ttft_ms, e.workload.output_tokens_per_s_per_gpu),
                    textcoords="offset points", xytext=(6, -10), fontsize=8)
    conc = f", concurrency {workload.concurrency}" if workload.concurrency else ", max throughput"
    ax.set_title(f"isl {workload.isl} / osl {workload.osl}{conc} (circles); curves: concurrency 1, 2, 4, …",
                 fontsize=10)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, "kiln plan estimate, " + ANCHOR_NOTE[:95] + "…", fontsize=6, alpha=0.7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_compare(entries: list[CompareEntry], workload: Workload, out_dir: Path) -> dict[str, Path]:
    """Write ``compare.json`` and ``compare.png`` into ``out_dir`` (created); the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "compare.json", "png": out_dir / "compare.png"}
    paths["json"].write_text(json.dumps(compare_json(entries, workload), indent=2) + "\n", encoding="utf-8")
    plot_compare(entries, workload, paths["png"])
    return paths


def render_compare(entries: list[CompareEntry], workload: Workload, console: Console) -> None:
    """The entries as one table (the workload's figures), then why any entry has none."""
    conc = workload.concurrency if workload.concurrency else "max throughput"
    table = Table(title=f"isl {workload.isl}, osl {workload.osl}, concurrency {conc}", title_justify="left")
    for col in ("recipe", "GPU", "tp×pp", "format", "batch (limit)", "TTFT ms", "TPOT ms", "E2E ms", "tok/s",
                "tok/s/GPU"):
        table.add_column(col, justify="left" if col in ("recipe", "GPU", "format") else "right")
    for e in entries:
        setup = [e.recipe, e.plan.gpu["name"], f"{e.plan.tp}×{e.plan.pp}",
                 f"{e.plan.weights.format}/{e.plan.kv_cache.dtype}"]
        w = e.workload
        if w is None:
            table.add_row(*setup, "—", "—", "—", "—", "—", "—")
            continue
        table.add_row(*setup, f"{w.batch} ({w.limited_by})", f"{w.ttft_ms:,.1f}", f"{w.tpot_ms:,.2f}",
                      f"{w.e2e_ms:,.0f}", f"{w.output_tokens_per_s:,.0f}", f"{w.output_tokens_per_s_per_gpu:,.0f}")
    console.print(table)
    for e in entries:
        if e.reason:
            console.print(f"[yellow]{e.label}:[/] {e.reason}", highlight=False)
    console.print(f"[dim]Estimates {ANCHOR_NOTE}.[/]")
