"""Serving speed for a workload: TTFT, TPOT, end-to-end latency and tokens/s with in-flight batching.

The memory plan (:mod:`kiln.plan.planner`) says how much fits; this module says how fast it runs. It models one
engine in steady state under a closed loop: ``batch`` requests in flight, a finished one replaced at once. Each
engine step decodes one token for every generating sequence and, in some steps, carries prompt tokens too (a whole
prompt, several, or one chunk of a prompt when chunked context is on), never more than ``max_num_tokens`` in all.

A step's time per GPU is a roofline per phase with measured efficiencies (:data:`KERNELS`, NVIDIA's kernel
timings per GPU generation and precision), the tensor- and pipeline-parallel traffic over the GPU's interconnect
(the GPU table's published bandwidth and latency), and a few fitted scalars (:data:`FIT`, at most eight, fitted by
``benchmarks/fit_speed_model.py`` on published trtllm-bench rows; see ``SpeedPlan.anchors``).

Every time below is in seconds unless its name ends in ``_ms``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from kiln.plan.errors import PlanError
from kiln.plan.formats import base_dtype_bytes, base_tensor_key
from kiln.plan.result import Plan, SpeedPlan, StepTime, WorkloadPlan

__all__ = [
    "Workload",
    "SpeedParams",
    "Fractions",
    "SpeedModel",
    "fitted_params",
    "kernel_table",
    "fractions_for",
    "predict",
    "allreduce_seconds",
    "FIT_FILE",
    "KERNEL_FILE",
]

FIT_FILE = "speed_fit.json"
KERNEL_FILE = "kernel_efficiency.json"
FIXED_POINT_STEPS = 60


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths in tokens; ``concurrency`` None means "as many as the limits allow"."""

    isl: int
    osl: int
    concurrency: int | None = None

    def problems(self) -> list[str]:
        out = []
        for key in ("isl", "osl", "concurrency"):
            value = getattr(self, key)
            if value is None and key == "concurrency":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{key} must be a positive integer, got {value!r}")
        return out


@dataclass(frozen=True)
class SpeedParams:
    """The fitted scalars (see ``speed_fit.json`` for how they were fitted and on what)."""

    gemm_compute_scale: float
    prefill_attention_scale: float
    step_overhead_ms: float
    sequence_overhead_us: float

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _data(name: str) -> dict[str, Any]:
    return json.loads(resources.files("kiln.plan").joinpath("data", name).read_text(encoding="utf-8"))


@lru_cache(maxsize=1)
def kernel_table() -> dict[str, Any]:
    """The measured kernel fractions (``plan/data/kernel_efficiency.json``)."""
    return _data(KERNEL_FILE)


@lru_cache(maxsize=1)
def fitted_params() -> SpeedParams:
    """The fitted scalars shipped in ``plan/data/speed_fit.json``."""
    return SpeedParams(**_data(FIT_FILE)["params"])


@dataclass(frozen=True)
class Fractions:
    """Achievable fractions of the GPU's peaks for one plan (its GPU generation, formats and KV dtype)."""

    generation: str
    measured_on: str
    gemm_compute: dict[str, float]
    weight_stream: dict[str, float]
    overlap: dict[str, float]
    decode_attention: float
    prefill_attention: float


def fractions_for(sm: int, gemm_types: list[str], kv_dtype: str) -> Fractions:
    """The measured fractions for a GPU of compute capability ``sm``, GEMM tensor types (``base``, ``fp8``,
    ``int8``, ``fp4``) and KV-cache dtype (``fp16``, ``bf16``, ``fp8``, ``int8``), stand-ins applied."""
    table = kernel_table()
    gen_name, gen = next(((n, g) for n, g in table["generations"].items() if g["sm"][0] <= sm <= g["sm"][1]),
                         (None, None))
    if gen is None:
        raise PlanError(f"no measured kernel efficiency for SM {sm} (known: "
                        + ", ".join(f"{n} SM {g['sm'][0]}-{g['sm'][1]}" for n, g in table["generations"].items())
                        + ")")
    stand = table["stand_ins"]
    compute, stream, overlap = {}, {}, {}
    for gemm in gemm_types:
        key = stand["gemm"].get(gemm, gemm)
        if key not in gen["gemm_compute"]:
            raise PlanError(f"no measured {key} GEMM efficiency for {gen_name} GPUs")
        compute[gemm] = gen["gemm_compute"][key]
        stream[gemm] = gen["weight_stream"][key]
        overlap[gemm] = table["gemm_overlap"][key]
    kv_key = stand["kv"].get(kv_dtype, kv_dtype)
    attention = gen["decode_attention"].get(kv_key, gen["decode_attention"]["bf16"])
    return Fractions(gen_name, gen["measured_on"], compute, stream, overlap, attention, gen["prefill_attention"])


def allreduce_seconds(nbytes: float, gpus: int, latency_us: float, link_gbs: float) -> float:
    """One all-reduce of ``nbytes`` over ``gpus`` GPUs: the link's latency plus the ring's traffic, each GPU
    sending 2(n−1)/n × nbytes over its link (nccl-tests' bus-bandwidth definition). 0 for one GPU."""
    if gpus <= 1:
        return 0.0
    return latency_us * 1e-6 + 2 * (gpus - 1) / gpus * nbytes / (link_gbs * 1e9)


def _combine(stream_s: float, math_s: float, overlap: float) -> float:
    """A GEMM's time from its two rooflines: the longer one plus ``overlap`` of the shorter (see
    kernel_efficiency.json: measured kernels are slower than either roofline alone)."""
    return max(stream_s, math_s) + overlap * min(stream_s, math_s)


class SpeedModel:
    """The step-time and steady-state model for one :class:`~kiln.plan.result.Plan`."""

    def __init__(self, plan: Plan, params: SpeedParams | None = None) -> None:
        self.plan = plan
        self.params = params or fitted_params()
        s, gpu, model = plan.settings, plan.gpu, plan.model
        self.tp, self.pp = plan.tp, plan.pp
        self.hidden = model["hidden_size"]
        self.head_dim = model["head_dim"]
        self.heads_per_gpu = model["num_heads"] // self.tp
        self.act_bytes = base_dtype_bytes(s["dtype"])
        self.bandwidth = gpu["bandwidth_gbs"] * 1e9
        self.link = gpu.get("interconnect")
        if (self.tp > 1 or self.pp > 1) and not self.link:
            raise PlanError(f"{gpu['name']} has no interconnect figures in the GPU table: tp/pp traffic unknown")
        base_key = base_tensor_key(s["dtype"])
        if base_key is None or base_key not in gpu["tflops"]:
            raise PlanError(f"{s['dtype']} has no tensor-core figure for {gpu['name']}: speed not estimated")
        self.peaks = {"base": gpu["tflops"][base_key] * 1e12}
        types = sorted({t for st in plan.stages for t in st.gemm_params} | {st.lm_head_gemm for st in plan.stages})
        for t in types:
            if t != "base":
                if t not in gpu["tflops"]:
                    raise PlanError(f"{gpu['name']} has no {t} tensor-core figure: speed not estimated")
                self.peaks[t] = gpu["tflops"][t] * 1e12
        kv_dtype = plan.kv_cache.dtype if plan.kv_cache.dtype != s["dtype"] else str(base_key)
        self.fractions = fractions_for(gpu["sm"], types, kv_dtype)
        fp8_attention = s.get("fp8_context_fmha") and plan.kv_cache.dtype == "fp8" and "fp8" in gpu["tflops"]
        self.attention_peak = gpu["tflops"]["fp8" if fp8_attention else base_key] * 1e12
        self.attention_type = "fp8" if fp8_attention else base_key

    # ------------------------------------------------------------------------------------------ one step

    def _gemm(self, kind: str, params: float, nbytes: float, rows: float) -> float:
        f = self.fractions
        stream = nbytes / (f.weight_stream[kind] * self.bandwidth)
        math_s = 2 * params * rows / (f.gemm_compute[kind] * self.params.gemm_compute_scale * self.peaks[kind])
        return _combine(stream, math_s, f.overlap[kind])

    def _stage(self, stage, decode: float, context: float, prefill: float, isl: int, last: bool) -> dict[str, float]:
        """One stage's time for ``decode`` sequences at mean context ``context`` and ``prefill`` prompt tokens
        of ``isl``-token prompts (tokens of this micro-batch)."""
        tokens = decode + prefill
        logits_rows = decode + prefill / isl
        gemm = sum(self._gemm(kind, p, stage.gemm_bytes[kind], tokens) for kind, p in stage.gemm_params.items())
        if stage.lm_head_params:
            gemm += self._gemm(stage.lm_head_gemm, stage.lm_head_params, stage.lm_head_read_bytes, logits_rows)
        decode_attn = decode * context * stage.kv_bytes_per_token / (self.fractions.decode_attention * self.bandwidth)
        prefill_flops = 2 * stage.layers * self.heads_per_gpu * self.head_dim * prefill * isl
        prefill_attn = prefill_flops / (self.fractions.prefill_attention * self.params.prefill_attention_scale
                                        * self.attention_peak)
        comm = 0.0
        if self.tp > 1:
            comm += 2 * stage.layers * allreduce_seconds(tokens * self.hidden * self.act_bytes, self.tp,
                                                         self.link["latency_us"], self.link["gbs"])
        if self.pp > 1 and not last:
            comm += self.link["latency_us"] * 1e-6 + tokens * self.hidden * self.act_bytes / (self.link["gbs"] * 1e9)
        return {"gemm": gemm, "decode_attention": decode_attn, "prefill_attention": prefill_attn, "communication": comm}

    def step(self, decode: float, context: float, prefill: float, isl: int) -> StepTime:
        """The engine's time for one step with ``decode`` generating sequences (mean KV context ``context``
        tokens) and ``prefill`` prompt tokens from ``isl``-token prompts. With pp > 1 the batch runs as pp
        micro-batches: every micro-batch passes each stage once, so the step takes pp × the slowest stage."""
        pp = self.pp
        stages = [self._stage(st, decode / pp, context, prefill / pp, isl, i == pp - 1)
                  for i, st in enumerate(self.plan.stages)]
        slowest = max(stages, key=lambda d: sum(d.values()))
        p = self.params
        overhead = p.step_overhead_ms * 1e-3 + p.sequence_overhead_us * 1e-6 * (decode + prefill / isl)
        parts = {k: v * pp for k, v in slowest.items()}
        total = sum(parts.values()) + overhead
        return StepTime(decode=decode, prefill=prefill, gemm_ms=parts["gemm"] * 1e3,
                        decode_attention_ms=parts["decode_attention"] * 1e3,
                        prefill_attention_ms=parts["prefill_attention"] * 1e3,
                        communication_ms=parts["communication"] * 1e3, overhead_ms=overhead * 1e3,
                        total_ms=total * 1e3)

    # --------------------------------------------------------------------------------------- the workload

    def limits(self, wl: Workload) -> dict[str, int]:
        """The largest batch each engine limit allows for this workload.

        - ``kv_cache``: whole requests whose blocks fit (the scheduler reserves isl + osl tokens for each, as
          TensorRT-LLM's default GUARANTEED_NO_EVICT policy does);
        - ``max_batch_size``: as set;
        - ``max_num_tokens``: a steady state processes osl − 1 decode tokens and isl prompt tokens per request,
          about ``batch / osl`` requests per step, so batch × (isl + osl − 1) / osl tokens per step must fit;
          without chunked context a whole prompt must also fit beside the decodes.
        """
        s = self.plan.settings
        tpb, m = s["tokens_per_block"], s["max_num_tokens"]
        blocks = math.ceil((wl.isl + wl.osl) / tpb)
        out = {"kv_cache": self.plan.kv_cache.blocks // blocks, "max_batch_size": s["max_batch_size"],
               "max_num_tokens": m * wl.osl // (wl.isl + wl.osl - 1)}
        if not s.get("enable_chunked_context") and wl.osl > 1:
            out["max_num_tokens"] = min(out["max_num_tokens"], (m - wl.isl) * wl.osl // (wl.osl - 1))
        return out

    def check(self, wl: Workload) -> None:
        """PlanError when the engine would refuse the workload's requests."""
        s = self.plan.settings
        problems = wl.problems()
        if not problems:
            if wl.isl > s["max_input_len"]:
                problems.append(f"isl {wl.isl} exceeds max_input_len {s['max_input_len']}: raise "
                                "engine.max_input_len or shorten the prompts")
            if wl.isl + wl.osl > s["max_seq_len"]:
                problems.append(f"isl + osl = {wl.isl + wl.osl} exceeds max_seq_len {s['max_seq_len']}")
            if wl.isl > s["max_num_tokens"] and not s.get("enable_chunked_context"):
                problems.append(f"isl {wl.isl} exceeds max_num_tokens {s['max_num_tokens']} and chunked context "
                                "is off: set serving.enable_chunked_context: true or raise engine.max_num_tokens")
        if problems:
            raise PlanError("workload: " + "; ".join(problems))

    def predict(self, wl: Workload) -> tuple[WorkloadPlan, SpeedPlan]:
        """TTFT, TPOT, E2E and tokens/s for ``wl``, and how they were reached."""
        self.check(wl)
        isl, osl = wl.isl, wl.osl
        limits = self.limits(wl)
        name, most = min(limits.items(), key=lambda kv: kv[1])
        if most < 1:
            raise PlanError(f"workload: not one {isl}+{osl}-token request fits ({name} allows {most})")
        batch, limited_by = most, name
        if wl.concurrency is not None and wl.concurrency <= most:
            batch, limited_by = wl.concurrency, "concurrency"
        s = self.plan.settings
        context = isl + osl / 2  # a generating sequence's mean KV length
        rate = batch / osl  # requests finished per step; refined below (Little's law)
        for _ in range(FIXED_POINT_STEPS):
            decode = rate * (osl - 1)
            demand = rate * isl  # prompt tokens per step
            room = s["max_num_tokens"] - decode  # what a step has left beside the decodes
            chunk = min(room, max(demand, isl))  # prompt tokens in a step that carries prompt tokens
            share = min(1.0, demand / chunk)  # the fraction of steps that do
            prompt_steps = math.ceil(isl / room - 1e-9)
            mixed = self.step(decode, context, chunk, isl)
            plain = self.step(decode, context, 0.0, isl)
            mean_ms = share * mixed.total_ms + (1 - share) * plain.total_ms
            ttft_ms = prompt_steps * mixed.total_ms
            e2e_ms = ttft_ms + (osl - 1) * mean_ms
            new_rate = batch * mean_ms / e2e_ms
            if abs(new_rate - rate) <= 1e-12 * rate:
                break
            rate = new_rate
        per_s = batch / (e2e_ms * 1e-3)  # requests per second (Little's law: batch in flight for E2E each)
        wait_ms = 0.0
        if wl.concurrency is not None and wl.concurrency > batch:
            wait_ms = (wl.concurrency - batch) / per_s * 1e3  # closed loop: wait for that many to finish
        tokens_per_s = per_s * osl
        workload = WorkloadPlan(isl=isl, osl=osl, concurrency=wl.concurrency, batch=batch, limited_by=limited_by,
                                ttft_ms=ttft_ms + wait_ms, tpot_ms=mean_ms, e2e_ms=e2e_ms + wait_ms,
                                output_tokens_per_s=tokens_per_s,
                                output_tokens_per_s_per_gpu=tokens_per_s / self.plan.world_size)
        f = self.fractions
        detail = SpeedPlan(
            limits=limits, requests_per_s=per_s, prefill_tokens_per_step=demand, steps_with_prefill=share,
            prompt_steps=prompt_steps, queue_wait_ms=wait_ms, decode_step=plain, prefill_step=mixed,
            fractions={"generation": f.generation, "measured_on": f.measured_on, "gemm_compute": f.gemm_compute,
                       "weight_stream": f.weight_stream, "gemm_overlap": f.overlap,
                       "decode_attention": f.decode_attention, "prefill_attention": f.prefill_attention,
                       "prefill_attention_peak": self.attention_type},
            fitted={"file": f"kiln/plan/data/{FIT_FILE}", **dataclasses.asdict(self.params)},
        )
        return workload, detail


def predict(plan: Plan, workload: Workload, params: SpeedParams | None = None) -> tuple[WorkloadPlan, SpeedPlan]:
    """:meth:`SpeedModel.predict` for ``plan`` (PlanError when the workload or the plan cannot be estimated)."""
    return SpeedModel(plan, params).predict(workload)
