"""kiln plan's speed model (kiln/plan/speed.py): accuracy against NVIDIA's published trtllm-bench rows, the fitted
scalars against the script that fits them, and hand-checked arithmetic for the communication term, the chunked
prefill mix and the batch limits.

The expected numbers of the hand-checked tests are written out with their arithmetic in the comments; none is
produced by calling the code under test.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import statistics
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from kiln.plan import PlanError, PlanInputs, SpeedModel, Workload, make_plan, resolve_gpu, shipped_model_config
from kiln.plan import anchors as anchor_module
from kiln.plan.anchors import accuracy, anchors, bench_settings, summary
from kiln.plan.result import StepTime
from kiln.plan.speed import _combine as combine
from kiln.plan.speed import allreduce_seconds, fitted_params, kernel_table

FIT_SCRIPT = REPO_ROOT / "benchmarks" / "fit_speed_model.py"
FIT_FILE = REPO_ROOT / "src" / "kiln" / "plan" / "data" / "speed_fit.json"
PAIRS = {(128, 128), (128, 2048), (128, 4096), (500, 2000), (1000, 1000), (1000, 2000), (2048, 128), (2048, 2048),
         (5000, 500), (20000, 2000)}


@pytest.fixture(scope="module")
def llama8b() -> dict:
    return shipped_model_config("hf:meta-llama/Llama-3.1-8B-Instruct")


@pytest.fixture(scope="module")
def llama70b() -> dict:
    return shipped_model_config("hf:meta-llama/Llama-3.1-70B-Instruct")


def _fit_script():
    spec = importlib.util.spec_from_file_location("fit_speed_model", FIT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ the anchors


def test_anchor_rows_are_every_row_the_issue_asked_for_with_their_source() -> None:
    doc = anchors()
    groups = {
        ("Llama-3.1-8B-Instruct-FP8", "H200 SXM 141GB", 1): "fit",
        ("Llama-3.1-8B-Instruct-FP8", "H100 SXM 80GB", 1): "fit",
        ("Llama-3.3-70B-Instruct-FP8", "H200 SXM 141GB", 1): "held_out",
        ("Llama-3.3-70B-Instruct-FP8", "H100 SXM 80GB", 2): "held_out",
    }
    assert len(doc["rows"]) == 40
    for key, role in groups.items():
        rows = [r for r in doc["rows"] if (r["model"], r["gpu"], r["tp"]) == key]
        assert {(r["isl"], r["osl"]) for r in rows} == PAIRS, key
        assert {r["role"] for r in rows} == {role}, key
    # One metric, the page's own wording, on every row (the page switched to per-GPU figures after v1.0).
    assert {r["metric"] for r in doc["rows"]} == {"Total Output Throughput (tokens/sec)"}
    src = doc["source"]
    assert (src["repo"], src["path"], src["commit"]) == (
        "NVIDIA/TensorRT-LLM", "docs/source/performance/perf-overview.md", "00f37686aa854010d68bcbd0f4ab000221541ca6")
    assert "PyTorch backend" in doc["backend"] and "proxy" in doc["backend"]
    # Spot checks against the page (v1.0 tables): 8B H200 1000/1000 and 70B H100 tp 2 2048/128.
    value = {(r["model"][:14], r["gpu"][:4], r["isl"], r["osl"]): r["value"] for r in doc["rows"]}
    assert value[("Llama-3.1-8B-I", "H200", 1000, 1000)] == 17744
    assert value[("Llama-3.3-70B-", "H100", 2048, 128)] == 762


def test_trtllm_bench_settings_follow_its_heuristic(llama8b: dict) -> None:
    # Llama 3.1 8B, FP8, H200 (140.4 GiB as the driver reports), tp 1, isl 20000 / osl 2000:
    #   KV per token 2 × 32 layers × max(1, 8) KV heads × 128 × 1 byte = 65,536 B = 6.1035e-5 GiB
    #   weights 8,030,261,248 params × 1 byte = 7.4787 GiB; free (140.4 − 7.4787) × 0.95 = 126.275 GiB
    #   requests 126.275 / (6.1035e-5 × 22,000) = 94.04 -> batch below 256: max(64, 32 × ceil(94.04/32)) = 96
    #   tokens 94.04 × (1 + 10) = 1,034 -> max(2048, 256 × ceil(1034/256) = 1280) = 2048; no chunked prefill:
    #   max(2048, 20000 + 96) = 20,096
    assert bench_settings(llama8b, 140.4, 1, 20000, 2000) == (96, 20096)
    # 128/128: requests far above 4096 -> capped at 4096 (a multiple of 256); tokens 4096 × 2 = 8192.
    assert bench_settings(llama8b, 140.4, 1, 128, 128) == (4096, 8192)


# ------------------------------------------------------------------------------ the fit and its accuracy


def test_fitted_scalars_are_the_fit_scripts_output() -> None:
    shipped = json.loads(FIT_FILE.read_text(encoding="utf-8"))
    assert _fit_script().fit_document() == shipped
    assert len(shipped["params"]) <= 8
    # Every shipped scalar is the one the default model predicts with: perturbing any one of them alone moves
    # a step that exercises them all (prompt tokens, compute-bound GEMMs, per-step and per-sequence overhead).
    import dataclasses

    from kiln.plan.speed import SpeedParams

    assert dataclasses.asdict(fitted_params()) == shipped["params"]
    llama8b = shipped_model_config("hf:meta-llama/Llama-3.1-8B-Instruct")
    plan = make_plan(PlanInputs(model_config=llama8b, weight_format="fp8", kv_cache="fp8", max_input_len=3000,
                                max_seq_len=4096), resolve_gpu("H100-SXM"))
    default = SpeedModel(plan).step(256, 2048, 2048, 1024).total_ms
    assert SpeedModel(plan, SpeedParams(**shipped["params"])).step(256, 2048, 2048, 1024).total_ms == default
    for name, value in shipped["params"].items():
        moved = SpeedParams(**{**shipped["params"], name: value * 1.5 + 0.1})
        assert SpeedModel(plan, moved).step(256, 2048, 2048, 1024).total_ms != default, name


def test_the_fit_never_sees_the_held_out_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Scale every 70B figure by 10: a fit that used them would move; the shipped fit must not.
    doc = json.loads(json.dumps(anchors()))
    for row in doc["rows"]:
        if row["role"] == "held_out":
            row["value"] *= 10
    monkeypatch.setattr(anchor_module, "anchors", lambda: doc)
    script = _fit_script()
    monkeypatch.setattr(script, "anchors", lambda: doc)
    assert script.fit_document()["params"] == json.loads(FIT_FILE.read_text())["params"]


def test_accuracy_against_the_published_rows() -> None:
    rows = accuracy()
    print("\nmodel                       gpu             tp     isl/osl role      published  predicted   error")
    for r in rows:
        print(f"{r.model:<27} {r.gpu:<15} {r.tp:>2} {f'{r.isl}/{r.osl}':>11} {r.role:<8} {r.published:>10,.0f} "
              f"{r.predicted:>10,.0f} {r.error * 100:>+6.1f}%")
    held_out = [r for r in rows if r.role == "held_out"]
    assert len(held_out) == 20 and all("70B" in r.model for r in held_out)
    outside = [(r.model, r.gpu, r.isl, r.osl, round(r.error, 3)) for r in held_out if abs(r.error) > 0.30]
    assert not outside, f"held-out rows beyond ±30%: {outside}"
    median = statistics.median(abs(r.error) for r in rows)
    assert median <= 0.15, median
    assert summary(rows)["median_abs_error"] == median
    # The tp 2 rows are the ones with all-reduce traffic: they must be predicted as well as the tp 1 rows.
    assert max(abs(r.error) for r in held_out if r.tp == 2) <= 0.30


# ------------------------------------------------------------------------------- measured kernel fractions


def test_gemm_overlap_reproduces_nvidias_measured_h100_gemms() -> None:
    # t = max(stream, math) + overlap × min(stream, math) against H100 SXM timings of an 8192 × 8192 GEMM.
    # bf16, m = 256: stream 8192² × 2 B / (0.802 × 3.35e12) = 49.95 µs; math 2 × 256 × 8192² / (0.779 ×
    # 989e12) = 44.60 µs -> 49.95 + 0.15 × 44.60 = 56.64 µs; measured 2 × 256 × 8192² / (0.62 × 989e12)
    # = 56.04 µs.
    table = kernel_table()
    hopper, check = table["generations"]["hopper"], table["overlap_check"]
    gpu = resolve_gpu(check["gpu"])
    n, k = check["shape"]["n"], check["shape"]["k"]
    for kind, points in check["achieved_fraction_of_dense_peak_by_m"].items():
        peak = gpu.tflops[kind] * 1e12
        nbytes = n * k * (2 if kind == "bf16" else 1)
        for m, achieved in points.items():
            flops = 2 * int(m) * n * k
            stream = nbytes / (hopper["weight_stream"][kind] * gpu.bandwidth_gbs * 1e9)
            math_s = flops / (hopper["gemm_compute"][kind] * peak)
            model = combine(stream, math_s, table["gemm_overlap"][kind])  # the speed model's own formula
            assert model == pytest.approx(flops / (achieved * peak), rel=0.15), (kind, m)


def test_every_fraction_is_a_fraction_of_the_peak() -> None:
    params = fitted_params()
    for name, gen in kernel_table()["generations"].items():
        for kind in ("gemm_compute", "weight_stream", "decode_attention"):
            assert all(0 < v <= 1 for v in gen[kind].values()), (name, kind)
        assert 0 < max(gen["gemm_compute"].values()) * params.gemm_compute_scale <= 1, name
        assert 0 < gen["prefill_attention"] * params.prefill_attention_scale <= 1, name


# ------------------------------------------------------------------------------------ hand-checked terms


@pytest.mark.parametrize(
    ("tp", "expected_ms"),
    [
        # Llama 70B FP8 on H100 SXM (NVLink 4: 450 GB/s per direction, 2.8 µs all-reduce latency), one decode
        # step of 64 sequences: each all-reduce carries 64 tokens × 8192 hidden × 2 bytes (bf16) = 1,048,576 B,
        # and each GPU sends 2(tp−1)/tp of it: 1,048,576 / 450e9 = 2.330169 µs per full message.
        # 2 all-reduces per layer × 80 layers = 160 per step.
        (1, 0.0),  # no tensor parallelism, no traffic
        (2, 160 * (2.8 + 1.00 * 2.330169) / 1e3),  # 160 × 5.130169 µs = 0.820827 ms
        (4, 160 * (2.8 + 1.50 * 2.330169) / 1e3),  # 160 × 6.295253 µs = 1.007240 ms
        (8, 160 * (2.8 + 1.75 * 2.330169) / 1e3),  # 160 × 6.877796 µs = 1.100447 ms
    ],
)
def test_tensor_parallel_communication_by_hand(llama70b: dict, tp: int, expected_ms: float) -> None:
    plan = make_plan(PlanInputs(model_config=llama70b, weight_format="fp8", kv_cache="fp8", dtype="bfloat16", tp=tp,
                                max_seq_len=4096, max_input_len=2048), resolve_gpu("H100-SXM"))
    step = SpeedModel(plan).step(64, 2048, 0, 1024)
    assert step.communication_ms == pytest.approx(expected_ms, rel=1e-5)
    assert allreduce_seconds(1_048_576, tp, 2.8, 450.0) * 160 * 1e3 == pytest.approx(expected_ms, rel=1e-5)


def test_pipeline_stages_pass_activations_over_the_link(llama70b: dict) -> None:
    # pp 2 on H100 SXM, a decode step of 64 sequences run as 2 micro-batches of 32: stage 0 sends each
    # micro-batch's activations to stage 1: 32 tokens × 8192 × 2 B = 524,288 B -> 2.8 µs + 524,288 / 450e9 s
    # = 2.8 + 1.165084 = 3.965084 µs. The last stage sends nothing. Every micro-batch passes both stages, so
    # the step takes 2 × the slower stage (here stage 1, which also streams lm_head).
    plan = make_plan(PlanInputs(model_config=llama70b, weight_format="fp8", kv_cache="fp8", dtype="bfloat16", pp=2,
                                max_seq_len=4096, max_input_len=2048), resolve_gpu("H100-SXM"))
    model = SpeedModel(plan)
    stage0 = model._stage(plan.stages[0], 32, 2048, 0, 1024, last=False)
    stage1 = model._stage(plan.stages[1], 32, 2048, 0, 1024, last=True)
    assert stage0["communication"] == pytest.approx(3.965084e-6, rel=1e-6)
    assert stage1["communication"] == 0.0
    slower = max(sum(stage0.values()), sum(stage1.values()))
    step = model.step(64, 2048, 0, 1024)
    assert step.total_ms - step.overhead_ms == pytest.approx(2 * slower * 1e3, rel=1e-9)


class _FixedSteps(SpeedModel):
    """A stand-in step time, so the steady-state arithmetic can be checked by hand: 10 ms per step, 20 ms for
    a step that carries prompt tokens (whatever their number)."""

    def step(self, decode: float, context: float, prefill: float, isl: int) -> StepTime:
        total = 20.0 if prefill > 0 else 10.0
        return StepTime(decode, prefill, total, 0.0, 0.0, 0.0, 0.0, total)


def _plan_8b(llama8b: dict, **kw):
    base = dict(model_config=llama8b, weight_format="fp8", kv_cache="fp8", max_input_len=3000, max_seq_len=4096)
    return make_plan(PlanInputs(**{**base, **kw}), resolve_gpu("H100-SXM"))


def test_prompt_steps_mixed_into_decode_steps_by_hand(llama8b: dict) -> None:
    # isl 3000, osl 101, 10 requests in flight, max_num_tokens 8000, no chunked context. r = requests finished
    # per step; 100 r sequences decode each step, 3000 r prompt tokens arrive per step. A step has room for
    # 8000 − 100 r ≥ 3000 tokens beside the decodes, so each prompt goes whole in one step (TTFT = one 20 ms
    # step) and a fraction r of the steps carry one: TPOT = r × 20 + (1 − r) × 10 = 10 + 10 r.
    # Little's law, 10 = (r / TPOT) × E2E with E2E = 20 + 100 × TPOT:
    #   10 (10 + 10 r) = 20 r + 100 r (10 + 10 r)  ->  1000 r² + 920 r − 100 = 0
    #   r = (−920 + √(920² + 400,000)) / 2000 = (−920 + 1116.42286) / 2000 = 0.0982114
    #   TPOT = 10.982114 ms; E2E = 20 + 1098.2114 = 1118.2114 ms; tokens/s = r / TPOT × 101 = 903.228
    wl, sp = _FixedSteps(_plan_8b(llama8b, max_num_tokens=8000)).predict(Workload(3000, 101, 10))
    assert (wl.batch, wl.limited_by, sp.prompt_steps) == (10, "concurrency", 1)
    assert wl.ttft_ms == pytest.approx(20.0)
    assert wl.tpot_ms == pytest.approx(10.982114, rel=1e-6)
    assert wl.e2e_ms == pytest.approx(1118.2114, rel=1e-6)
    assert wl.output_tokens_per_s == pytest.approx(903.228, rel=1e-5)
    assert sp.steps_with_prefill == pytest.approx(0.0982114, rel=1e-5)  # = r: one whole prompt per such step


def test_chunked_prompts_by_hand(llama8b: dict) -> None:
    # The same workload with max_num_tokens 2000 and chunked context: a step has room for 2000 − 100 r
    # (≈ 1990) tokens beside the decodes, so a 3000-token prompt takes ceil(3000 / 1990) = 2 chunked steps
    # (TTFT = 2 × 20 = 40 ms), and a fraction 3000 r / (2000 − 100 r) of the steps carry a chunk:
    #   TPOT = 10 + 10 × 3000 r / (2000 − 100 r) = 10 + 300 r / (20 − r)
    # Little's law, 10 = (r / TPOT)(40 + 100 TPOT)  ->  TPOT = 4 r / (1 − 10 r). Equating:
    #   4 r (20 − r) = (200 + 290 r)(1 − 10 r)  ->  2896 r² + 1790 r − 200 = 0
    #   r = (−1790 + √(1790² + 2,316,800)) / 5792 = (−1790 + 2349.65955) / 5792 = 0.0966263
    #   TPOT = 10 + 300 × 0.0966263 / 19.9033737 = 11.456431 ms; tokens/s = r / TPOT × 101 = 851.858
    wl, sp = _FixedSteps(_plan_8b(llama8b, max_num_tokens=2000, enable_chunked_context=True)).predict(
        Workload(3000, 101, 10))
    assert (wl.batch, sp.prompt_steps) == (10, 2)
    assert wl.ttft_ms == pytest.approx(40.0)
    assert wl.tpot_ms == pytest.approx(11.456431, rel=1e-6)
    assert wl.output_tokens_per_s == pytest.approx(851.858, rel=1e-5)
    assert sp.prefill_tokens_per_step == pytest.approx(3000 * 0.0966263, rel=1e-5)
    # Without chunked context the prompt could never fit a 2000-token step: the workload is refused.
    with pytest.raises(PlanError, match="isl 3000 exceeds max_num_tokens 2000 and chunked context is off"):
        SpeedModel(_plan_8b(llama8b, max_num_tokens=2000)).predict(Workload(3000, 101, 10))


def test_a_prompt_step_costs_its_prompt_attention(llama8b: dict) -> None:
    # Prompt attention per GPU: 2 × 32 layers × 32 heads × 128 × chunk × isl FLOPs; a 1024-token prompt
    # alone: 2 × 32 × 32 × 128 × 1024 × 1024 = 274,877,906,944 FLOPs at 0.504 (measured, Hopper) × the
    # fitted scale × 989e12 (bf16: no fp8 context FMHA here).
    plan = _plan_8b(llama8b, max_num_tokens=8192)
    model = SpeedModel(plan)
    scale = fitted_params().prefill_attention_scale
    step = model.step(0, 0, 1024, 1024)
    assert step.prefill_attention_ms == pytest.approx(274_877_906_944 / (0.504 * scale * 989e12) * 1e3, rel=1e-9)
    assert step.decode_attention_ms == 0
    # Decode attention: 16 sequences at 2048 tokens of KV, 65,536 B each (fp8: 2 × 32 × 8 × 128 × 1), read at
    # 0.875 of 3.35 TB/s: 16 × 2048 × 65,536 = 2,147,483,648 B / 2.93125e12 B/s = 0.732617 ms.
    assert model.step(16, 2048, 0, 1024).decode_attention_ms == pytest.approx(0.732617, rel=1e-5)


def test_the_batch_and_what_limits_it(llama8b: dict) -> None:
    plan = _plan_8b(llama8b, max_num_tokens=8192, max_batch_size=2048)
    model = SpeedModel(plan)
    # isl 2048 / osl 16 without chunked context: 8192 × 16 // (2048 + 15) = 131,072 // 2063 = 63; a whole
    # prompt beside the decodes: (8192 − 2048) × 16 // 15 = 6553 -> 63. KV: blocks // ceil(2064 / 32) = 65.
    limits = model.limits(Workload(2048, 16))
    assert limits == {"kv_cache": plan.kv_cache.blocks // 65, "max_batch_size": 2048, "max_num_tokens": 63}
    wl, _ = model.predict(Workload(2048, 16))
    assert (wl.batch, wl.limited_by) == (63, "max_num_tokens")
    # Each other limit in turn: max_batch_size 32; a small KV budget; the workload's own concurrency.
    small_batch, _ = SpeedModel(_plan_8b(llama8b, max_batch_size=32)).predict(Workload(128, 128))
    assert (small_batch.batch, small_batch.limited_by) == (32, "max_batch_size")
    tight = _plan_8b(llama8b, kv_cache_free_gpu_mem_fraction=0.01)
    kv_bound, _ = SpeedModel(tight).predict(Workload(1000, 1000))
    assert (kv_bound.batch, kv_bound.limited_by) == (tight.kv_cache.blocks // 63, "kv_cache")  # ceil(2000/32) = 63
    few, _ = model.predict(Workload(2048, 16, 8))
    assert (few.batch, few.limited_by) == (8, "concurrency")
    # More clients than the limits allow: the batch stays at the limit and the rest wait for a slot (closed loop:
    # the 1000 − 63 requests ahead finish at requests_per_s).
    crowd, detail = model.predict(Workload(2048, 16, 1000))
    assert (crowd.batch, crowd.limited_by) == (63, "max_num_tokens")
    assert detail.queue_wait_ms == pytest.approx((1000 - 63) / detail.requests_per_s * 1e3)
    assert crowd.ttft_ms == pytest.approx(wl.ttft_ms + detail.queue_wait_ms, rel=1e-9)


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        (Workload(4000, 10), "isl 4000 exceeds max_input_len 3000"),
        (Workload(3000, 2000), "isl + osl = 5000 exceeds max_seq_len 4096"),
        (Workload(0, 10), "isl must be a positive integer"),
        (Workload(10, 10, 0), "concurrency must be a positive integer"),
    ],
)
def test_workloads_the_engine_would_refuse(llama8b: dict, workload: Workload, message: str) -> None:
    with pytest.raises(PlanError, match=re.escape(message)):
        SpeedModel(_plan_8b(llama8b)).predict(workload)


def test_memory_figures_do_not_move_with_a_workload(llama70b: dict) -> None:
    base = PlanInputs(model_config=llama70b, weight_format="fp8", kv_cache="fp8", tp=4, max_seq_len=4096,
                      max_input_len=2048)
    without = make_plan(base, resolve_gpu("H100-SXM")).to_dict()
    with_wl = make_plan(base, resolve_gpu("H100-SXM"), workload=Workload(1000, 1000)).to_dict()
    assert with_wl.pop("workload") is not None and with_wl.pop("speed") is not None
    without.pop("workload"), without.pop("speed")
    assert with_wl == without


def test_speed_is_not_predicted_for_a_plan_that_does_not_fit(llama70b: dict) -> None:
    plan = make_plan(PlanInputs(model_config=llama70b, weight_format="none", dtype="bfloat16"), resolve_gpu("H100-SXM"),
                     workload=Workload(1000, 1000))
    assert not plan.fits and plan.workload is None
    assert "no speed prediction: the plan does not fit" in plan.warnings


def test_nim_comparison_is_reported_not_gated() -> None:
    rows = anchor_module.nim_comparison()
    assert [r["concurrency"] for r in rows if r["isl"] == 5000] == [1, 5, 25, 50, 100, 150, 200, 250]
    one = next(r for r in rows if r["isl"] == 5000 and r["concurrency"] == 1)
    assert one["itl_ms"][0] == 18.58 and math.isfinite(one["itl_ms"][1])


def test_a_tp2_pp2_plan_by_hand_per_gpu(llama8b: dict) -> None:
    # Llama 3.1 8B FP8 (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 KV heads, head_dim 128, vocab
    # 128,256, lm_head untied and kept bf16) on tp 2 × pp 2 = 4 H100 SXM: each GPU holds half of the matrices
    # of half of the layers.
    plan = _plan_8b(llama8b, tp=2, pp=2, max_num_tokens=8192)
    assert (plan.tp, plan.pp, plan.world_size) == (2, 2, 4)
    # Per GPU, per layer (FP8: 1 byte per weight, each matrix split over tp 2):
    #   attention q,k,v,o = 4096 × (4096 + 1024 + 1024 + 4096) = 41,943,040 / 2 = 20,971,520 B; × 16 = 335,544,320
    #   MLP gate,up,down = 3 × 4096 × 14336 = 176,160,768 / 2 = 88,080,384 B; × 16 layers = 1,409,286,144
    #   norms (bf16, replicated) 2 × 4096 × 2 = 16,384 B; × 16 = 262,144 (+ the final norm's 8,192 on stage 1)
    #   embedding (stage 0) and lm_head (stage 1): 128,256 × 4096 × 2 B / 2 = 525,336,576 each
    # stage 0 = 525,336,576 + 335,544,320 + 1,409,286,144 + 262,144 = 2,270,429,184
    # stage 1 = 335,544,320 + 1,409,286,144 + 270,336 + 525,336,576 = 2,270,437,376 (the larger: per GPU)
    assert [s.layers for s in plan.stages] == [16, 16]
    assert [s.weights_bytes for s in plan.stages] == [2_270_429_184, 2_270_437_376]
    assert plan.weights.per_gpu_bytes == 2_270_437_376
    assert plan.weights.total_bytes == 9_081_200_640  # the whole model, as on one GPU
    # KV cache per token per GPU: 2 (K, V) × 16 layers × 8/2 = 4 KV heads × 128 × 1 B (fp8) = 16,384
    # (the whole model's 2 × 32 × 8 × 128 = 65,536 over 4 GPUs).
    assert plan.kv_cache.bytes_per_token == 65_536 and plan.kv_cache.bytes_per_token_per_gpu == 16_384
    # Stage 1 binds (lm_head and the logits buffer live there). Its workspace: 1 GiB runtime + activations
    # 8192 tokens × (3 × 4096 + (4096 + 1024 + 1024) / 2 + 4096 / 2 + 3 × 14336 / 2 = 38,912) × 2 B =
    # 637,534,208 + logits 2048 × 128,256 × 4 B = 1,050,673,152 -> 2,761,949,184.
    # Free = 79.65 GiB (85,523,536,282) − 2,270,437,376 − 2,761,949,184 = 80,491,149,722; × 0.9 =
    # 72,442,034,749 for the KV cache = 138,172 blocks of 32 tokens × 16,384 B (524,288 B per block).
    assert plan.workspace.total_bytes == 2_761_949_184
    assert plan.kv_cache.free_bytes_per_gpu == 80_491_149_722
    assert plan.kv_cache.budget_bytes_per_gpu == 72_442_034_749
    assert plan.kv_cache.blocks == 138_172
    # Speed per GPU: the steady state of test_prompt_steps_mixed_into_decode_steps_by_hand (stand-in 10 ms
    # steps, 20 ms with a prompt) gives 903.228 tokens/s for the engine; the engine is 4 GPUs, so
    # 903.228 / (tp 2 × pp 2) = 225.807 tokens/s per GPU (÷ tp alone would say 451.614).
    wl, _ = _FixedSteps(plan).predict(Workload(3000, 101, 10))
    assert wl.output_tokens_per_s == pytest.approx(903.228, rel=1e-5)
    assert wl.output_tokens_per_s_per_gpu == pytest.approx(225.807, rel=1e-5)
    # The real step model on the same plan: per GPU is the engine's figure over all four GPUs too.
    real, _ = SpeedModel(plan).predict(Workload(3000, 101, 10))
    assert real.output_tokens_per_s_per_gpu == pytest.approx(real.output_tokens_per_s / 4, rel=1e-12)
