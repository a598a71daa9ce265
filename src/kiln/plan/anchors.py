"""The published rows kiln's speed model is calibrated and checked against (``plan/data/speed_anchors.json``).

TensorRT-LLM 1.0's perf-overview page publishes max-throughput figures measured with ``trtllm-bench`` (PyTorch
backend, all requests queued at once). Each row is replayed here as a kiln plan: the model's shipped config, FP8
weights and KV cache, and the engine settings trtllm-bench would have picked (its tuning heuristic, restated in
the data file with its source). :func:`accuracy` compares kiln's prediction with each row, in the page's metric
(total output tokens/s over the tp group). The 8B rows fit the scalars (``benchmarks/fit_speed_model.py``);
the 70B rows are held out. NIM's latency-vs-concurrency rows (``speed_nim.json``) are a second, ungated
comparison (:func:`nim_comparison`).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from kiln.plan.model import parse_model_config, shipped_model_config
from kiln.plan.planner import make_plan
from kiln.plan.result import Plan, PlanInputs
from kiln.plan.speed import SpeedModel, SpeedParams, Workload
from kiln.recipe.gpus import lookup_gpu

__all__ = ["AccuracyRow", "accuracy", "anchors", "anchor_model", "bench_settings", "nim_comparison", "summary"]


def _data(name: str) -> dict[str, Any]:
    return json.loads(resources.files("kiln.plan").joinpath("data", name).read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def anchors() -> dict[str, Any]:
    """The anchor document: source, settings and rows."""
    return _data("speed_anchors.json")


def _round_up(value: float, step: int) -> int:
    return step * math.ceil(value / step)


def bench_settings(config: dict, gpu_memory_gib: float, tp: int, isl: int, osl: int,
                   fraction: float = 0.95) -> tuple[int, int]:
    """(max_batch_size, max_num_tokens) as trtllm-bench's tuning heuristic sets them for an FP8 model with an
    FP8 KV cache and no chunked prefill (the rule is restated in speed_anchors.json with its source)."""
    shape = parse_model_config(config)
    gib_per_token = 2 * shape.num_layers * max(tp, shape.num_kv_heads) * shape.head_dim * 1 / 2**30
    weights_gib = shape.total_params() * 1 / 2**30
    requests = (gpu_memory_gib * tp - weights_gib) * fraction / (gib_per_token * (isl + osl))
    batch = min(requests, 4096)
    tokens = min(batch * (1 + isl / osl), 32768)
    if batch < 256:
        max_batch = max(64, _round_up(batch, 32))
    elif batch < 1024:
        max_batch = _round_up(batch, 128)
    else:
        max_batch = _round_up(batch, 256)
    if tokens < 4096:
        max_tokens = max(2048, _round_up(tokens, 256))
    elif tokens < 8192:
        max_tokens = _round_up(tokens, 512)
    else:
        max_tokens = _round_up(tokens, 1024)
    return max_batch, max(max_tokens, isl + max_batch)


def _row_key(row: dict[str, Any]) -> tuple:
    return (row["model"], row["gpu"], row["tp"], row["isl"], row["osl"])


@lru_cache(maxsize=None)
def _plan(model: str, gpu_name: str, tp: int, isl: int, osl: int) -> Plan:
    doc = anchors()
    sim = doc["simulated_settings"]
    config = shipped_model_config(doc["models"][model]["config"])
    gpu = lookup_gpu(doc["gpus"][gpu_name])
    assert config is not None and gpu is not None, (model, gpu_name)
    max_batch, max_tokens = bench_settings(config, gpu.memory_gib, tp, isl, osl, sim["kv_cache_free_gpu_mem_fraction"])
    inputs = PlanInputs(model_config=config, weight_format="fp8", kv_cache="fp8", dtype="bfloat16", tp=tp,
                        max_batch_size=max_batch, max_input_len=isl, max_seq_len=isl + osl,
                        max_num_tokens=max_tokens,
                        kv_cache_free_gpu_mem_fraction=sim["kv_cache_free_gpu_mem_fraction"],
                        enable_chunked_context=sim["chunked_prefill"], fp8_context_fmha=sim["fp8_context_fmha"])
    plan = make_plan(inputs, gpu)
    assert plan.fits, plan.verdict
    return plan


def anchor_model(row: dict[str, Any], params: SpeedParams | None = None) -> SpeedModel:
    """The speed model for an anchor row's simulated engine (plans are cached; ``params`` may vary)."""
    return SpeedModel(_plan(*_row_key(row)), params)


@dataclass(frozen=True)
class AccuracyRow:
    """One published figure next to kiln's prediction (``error`` = predicted / published − 1)."""

    model: str
    gpu: str
    tp: int
    isl: int
    osl: int
    role: str
    published: float
    predicted: float
    error: float
    batch: int
    limited_by: str


def accuracy(params: SpeedParams | None = None, role: str | None = None) -> list[AccuracyRow]:
    """Every anchor row (or those of ``role``: ``fit`` or ``held_out``) against the prediction."""
    out = []
    for row in anchors()["rows"]:
        if role is not None and row["role"] != role:
            continue
        wl, _ = anchor_model(row, params).predict(Workload(row["isl"], row["osl"]))
        out.append(AccuracyRow(row["model"], row["gpu"], row["tp"], row["isl"], row["osl"], row["role"],
                               float(row["value"]), wl.output_tokens_per_s, wl.output_tokens_per_s / row["value"] - 1,
                               wl.batch, wl.limited_by))
    return out


def summary(rows: list[AccuracyRow]) -> dict[str, float]:
    """Median absolute error over all rows, and the worst error of the fit and held-out rows."""
    held = [abs(r.error) for r in rows if r.role == "held_out"]
    fit = [abs(r.error) for r in rows if r.role == "fit"]
    return {"median_abs_error": statistics.median(abs(r.error) for r in rows),
            "max_abs_error_fit": max(fit, default=0.0), "max_abs_error_held_out": max(held, default=0.0)}


def nim_comparison(params: SpeedParams | None = None) -> list[dict[str, Any]]:
    """NIM's published TTFT / ITL / throughput per concurrency next to kiln's prediction (reported only)."""
    out = []
    for table in _data("speed_nim.json")["tables"]:
        row = {"model": "Llama-3.3-70B-Instruct-FP8", "gpu": "H100 SXM 80GB", "tp": table["tp"],
               "isl": table["isl"], "osl": table["osl"]}
        model = anchor_model(row, params)
        for concurrency, ttft, itl, tput in table["rows"]:
            wl, _ = model.predict(Workload(table["isl"], table["osl"], concurrency))
            out.append({"isl": table["isl"], "osl": table["osl"], "concurrency": concurrency,
                        "ttft_ms": (ttft, wl.ttft_ms), "itl_ms": (itl, wl.tpot_ms),
                        "tokens_per_s": (tput, wl.output_tokens_per_s), "batch": wl.batch})
    return out
