"""The planner against hand calculations for published model configs.

Every expected number below is written out from the model's config.json with the arithmetic in the
comment; none is produced by calling the planner.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from kiln.plan import (
    PlanError,
    PlanInputs,
    load_model_config,
    make_plan,
    parse_model_config,
    render_plan,
    resolve_gpu,
    shipped_model_config,
    shipped_model_ids,
)
from kiln.plan.planner import GIB
from kiln.recipe.gpus import GPUS, GPUSpec

# A GPU with round figures so memory arithmetic is exact: 80 GiB = 85,899,345,920 bytes.
TEST_GPU = GPUSpec(
    name="TEST-80",
    aliases=(),
    sm=90,
    memory_gib=80.0,
    bandwidth_gbs=2000.0,
    tflops={"fp16": 1000.0, "bf16": 1000.0, "fp8": 2000.0, "int8": 2000.0},
    source="test",
)

# tiiuae/falcon-7b config.json (multi-query attention: one KV head; lm_head tied to the embedding).
FALCON_7B = {
    "alibi": False,
    "apply_residual_connection_post_layernorm": False,
    "architectures": ["FalconForCausalLM"],
    "attention_dropout": 0.0,
    "bias": False,
    "bos_token_id": 11,
    "eos_token_id": 11,
    "hidden_dropout": 0.0,
    "hidden_size": 4544,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "falcon",
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.27.4",
    "use_cache": True,
    "vocab_size": 65024,
}


@pytest.fixture(scope="module")
def llama8b() -> dict:
    config = shipped_model_config("hf:meta-llama/Llama-3.1-8B-Instruct")
    assert config is not None
    return config


@pytest.fixture(scope="module")
def llama70b() -> dict:
    config = shipped_model_config("hf:meta-llama/Llama-3.1-70B-Instruct")
    assert config is not None
    return config


@pytest.fixture(scope="module")
def llama1b() -> dict:
    config = shipped_model_config("hf:meta-llama/Llama-3.2-1B-Instruct")
    assert config is not None
    return config


def _inputs(config: dict, **kw) -> PlanInputs:
    base = dict(
        model_config=config,
        weight_format="none",
        kv_cache="none",
        dtype="bfloat16",
        exclude_modules=("lm_head",),
        awq_block_size=128,
        tp=1,
        pp=1,
        max_batch_size=64,
        max_input_len=2048,
        max_seq_len=8192,
        max_num_tokens=8192,
        tokens_per_block=32,
        kv_cache_free_gpu_mem_fraction=0.9,
        max_tokens_in_paged_kv_cache=None,
    )
    base.update(kw)
    return PlanInputs(**base)


# ----------------------------------------------------------------------------------- parameter counts


def test_published_parameter_counts(llama8b: dict, llama70b: dict, llama1b: dict) -> None:
    # Llama-3.1-8B: embedding 128256×4096 = 525,336,576 (lm_head the same, untied);
    # per layer q 4096×4096 = 16,777,216, k and v 4096×1024 = 4,194,304 each, o 16,777,216,
    # MLP 3×4096×14336 = 176,160,768, norms 2×4096 = 8,192 -> 218,112,000; ×32 = 6,979,584,000;
    # final norm 4,096. Total 6,979,584,000 + 2×525,336,576 + 4,096 = 8,030,261,248 ("8.03B").
    assert parse_model_config(llama8b).total_params() == 8_030_261_248
    # Llama-3.1-70B: embedding 128256×8192 = 1,050,673,152; per layer q 67,108,864, k/v 8192×1024 =
    # 8,388,608 each, o 67,108,864, MLP 3×8192×28672 = 704,643,072, norms 16,384 -> 855,654,400;
    # ×80 = 68,452,352,000; + 2×1,050,673,152 + 8,192 = 70,553,706,496 ("70.6B").
    assert parse_model_config(llama70b).total_params() == 70_553_706_496
    # Llama-3.2-1B (tied, head_dim 64): embedding 128256×2048 = 262,668,288; per layer q 2048×2048 =
    # 4,194,304, k/v 2048×512 = 1,048,576 each, o 4,194,304, MLP 3×2048×8192 = 50,331,648, norms 4,096
    # -> 60,821,504; ×16 = 973,144,064; + 262,668,288 + 2,048 = 1,235,814,400 ("1.24B").
    assert parse_model_config(llama1b).total_params() == 1_235_814_400
    # falcon-7b: query_key_value 4544×(71×64 + 2×64) = 4544×4672 = 21,229,568, dense 4544×4544 =
    # 20,647,936, MLP 2×4544×18176 = 165,183,488, one LayerNorm (weight+bias) 9,088 -> 207,070,080;
    # ×32 = 6,626,242,560; embedding 65024×4544 = 295,469,056 (tied); ln_f 9,088 -> 6,921,720,704.
    shape = parse_model_config(FALCON_7B)
    assert shape.total_params() == 6_921_720_704
    assert (shape.num_kv_heads, shape.head_dim, shape.attention_kind) == (1, 64, "MQA")
    assert shape.tie_word_embeddings


# ------------------------------------------------------------------------------- weights and KV cache


def test_llama8b_bf16_on_80gib_memory_and_kv_capacity(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b), TEST_GPU)
    # Weights: 8,030,261,248 params × 2 bytes = 16,060,522,496.
    assert plan.weights.total_bytes == 16_060_522_496
    assert plan.weights.per_gpu_bytes == 16_060_522_496
    assert plan.weights.bytes_per_weight == 2
    # Workspace: activations per token 2 × (3×4096 + (4096 + 2×1024) + 4096 + 3×14336) = 2 × 65,536 =
    # 131,072 bytes; × max_num_tokens 8192 = 1,073,741,824. Logits 64 × 128256 × 4 = 32,833,536.
    # Runtime 1 GiB = 1,073,741,824. Total 2,180,317,184.
    assert plan.workspace.activation_bytes_per_token == 131_072
    assert plan.workspace.activation_bytes == 1_073_741_824
    assert plan.workspace.logits_bytes == 32_833_536
    assert plan.workspace.total_bytes == 2_180_317_184
    # KV per token: 2 × 32 layers × 8 KV heads × 128 × 2 bytes = 131,072 (128 KiB).
    kv = plan.kv_cache
    assert kv.bytes_per_token == 131_072
    assert kv.bytes_per_token_per_gpu == 131_072
    # Free: 85,899,345,920 − 16,060,522,496 − 2,180,317,184 = 67,658,506,240; budget 0.9 of that =
    # 60,892,655,616; tokens 60,892,655,616 // 131,072 = 464,574 -> 14,517 blocks of 32 = 464,544 tokens.
    assert kv.free_bytes_per_gpu == 67_658_506_240
    assert kv.budget_bytes_per_gpu == 60_892_655_616
    assert kv.blocks == 14_517
    assert kv.tokens == 464_544
    # A sequence of 8192 tokens = 256 blocks = 8192 × 131,072 = 1,073,741,824 bytes; 14,517 // 256 = 56.
    assert kv.blocks_per_sequence == 256
    assert kv.bytes_per_sequence_per_gpu == 1_073_741_824
    assert kv.max_sequences == 56
    assert plan.limits.max_concurrent_sequences == 56


def test_llama8b_batch_limit_is_reported_with_advice(llama8b: dict) -> None:
    # Same as above: 56 full-length sequences fit, so max_batch_size 64 is not reachable.
    plan = make_plan(_inputs(llama8b), TEST_GPU)
    assert plan.kv_cache.max_sequences == 56
    assert not plan.limits.batch_reachable
    assert plan.fits and plan.first_limit == "max_batch_size"
    assert "56 sequences" in plan.verdict
    # Advice: shrink the batch to 56, or max_seq_len to 14,517 // 64 × 32 = 226 × 32 = 7,232.
    assert any("max_batch_size 56" in a for a in plan.advice)
    assert any("max_seq_len ≤ 7232" in a for a in plan.advice)
    assert any(a.startswith("kv_cache fp8") for a in plan.advice)


def test_llama70b_int4_awq_tp4_per_gpu(llama70b: dict) -> None:
    plan = make_plan(_inputs(llama70b, weight_format="int4_awq", tp=4), GPUS["H100-SXM"])
    # Bytes per weight: 0.5 + 2/128 = 0.515625.
    assert plan.weights.bytes_per_weight == 0.515625
    # Per GPU (tp 4; 8 KV heads -> 2 per GPU):
    #   embedding 128256/4 = 32,064 rows × 8192 × 2 bytes = 525,336,576
    #   per layer: q 8192×2048 + o 2048×8192 = 2×16,777,216; k, v 8192×(2×128) = 2×2,097,152;
    #     gate, up 8192×7168 and down 7168×8192 = 3×58,720,256 -> 213,909,504 params × 0.515625 =
    #     110,297,088 bytes; norms 2×8192×2 = 32,768 -> 110,329,856; × 80 layers = 8,826,388,480
    #   final norm 8192×2 = 16,384; lm_head excluded: 32,064 × 8192 × 2 = 525,336,576
    #   total 525,336,576 + 8,826,388,480 + 16,384 + 525,336,576 = 9,877,078,016
    stage = plan.stages[0]
    assert stage.embedding_bytes == 525_336_576
    assert stage.lm_head_bytes == 525_336_576
    assert stage.attention_bytes + stage.mlp_bytes == 80 * 110_297_088
    assert plan.weights.per_gpu_bytes == 9_877_078_016
    assert plan.weights.excluded_matches == ["lm_head"]
    # Whole model (tp 1): embedding and lm_head 2 × 1,050,673,152 × 2 = 4,202,692,608; per layer
    # (855,654,400 − 16,384) × 0.515625 = 441,188,352 + 32,768 norms; × 80 = 35,297,689,600; + 16,384
    # -> 2,101,346,304 + 35,297,689,600 + 16,384 + 2,101,346,304 = 39,500,398,592.
    assert plan.weights.total_bytes == 39_500_398_592
    # KV per GPU per token (bf16): 2 × 80 × 2 KV heads × 128 × 2 = 81,920; whole model 327,680.
    assert plan.kv_cache.bytes_per_token_per_gpu == 81_920
    assert plan.kv_cache.bytes_per_token == 327_680
    assert plan.kv_cache.kv_heads_per_gpu == 2


def test_kv_heads_replicate_when_tp_exceeds_them(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, tp=16), TEST_GPU)
    # 8 KV heads on 16 GPUs: each GPU keeps 1 (replicated). KV per token per GPU 2×32×1×128×2 = 16,384.
    assert plan.kv_cache.kv_heads_per_gpu == 1
    assert plan.kv_cache.bytes_per_token_per_gpu == 16_384
    # Per GPU: embedding and lm_head 128256/16 = 8,016 rows × 4096 × 2 = 65,667,072 each; per layer
    # q, o 4096×256 = 1,048,576 each; k, v 4096×128 = 524,288 each; MLP 3 × 4096×896 = 11,010,048
    # -> 14,155,776 params + 8,192 norm params = 14,163,968 × 2 = 28,327,936 bytes; × 32 = 906,493,952;
    # final norm 8,192 bytes. Total 65,667,072×2 + 906,493,952 + 8,192 = 1,037,836,288.
    assert plan.weights.per_gpu_bytes == 1_037_836_288


def test_falcon7b_multi_query_fp8(tmp_path: Path) -> None:
    plan = make_plan(_inputs(FALCON_7B, weight_format="fp8", kv_cache="fp8"), TEST_GPU)
    # Linear weights per layer 21,229,568 + 20,647,936 + 165,183,488 = 207,060,992 × 1 byte; LayerNorm
    # 9,088 × 2 = 18,176 -> 207,079,168; × 32 = 6,626,533,376. Embedding 65024×4544×2 = 590,938,112,
    # tied lm_head adds nothing, ln_f 18,176. Total 7,217,489,664.
    assert plan.weights.per_gpu_bytes == 7_217_489_664
    assert plan.stages[0].lm_head_bytes == 0
    # Multi-query KV: 2 × 32 × 1 head × 64 × 1 byte = 4,096 bytes per token.
    assert plan.kv_cache.bytes_per_token == 4_096
    # bf16 KV doubles it: 8,192.
    bf16 = make_plan(_inputs(FALCON_7B, weight_format="fp8"), TEST_GPU)
    assert bf16.kv_cache.bytes_per_token == 8_192


def test_falcon7b_tp_must_divide_71_heads() -> None:
    with pytest.raises(PlanError, match=r"71 is not divisible by tp 2.*valid tp sizes for this model: \[1\]"):
        make_plan(_inputs(FALCON_7B, tp=2), TEST_GPU)


def test_llama1b_tied_nvfp4_and_pipeline_copy(llama1b: dict) -> None:
    # NVFP4: 0.5 + 1/16 = 0.5625 bytes per weight. Linear params per layer 10,485,760 + 50,331,648 =
    # 60,817,408 × 0.5625 = 34,209,792; norms 4,096 × 2 = 8,192 -> 34,217,984; × 16 = 547,487,744.
    # Embedding (shared with lm_head) 262,668,288 × 2 = 525,336,576; final norm 4,096.
    # Total 525,336,576 + 547,487,744 + 4,096 = 1,072,828,416.
    plan = make_plan(_inputs(llama1b, weight_format="nvfp4"), GPUS["B200"])
    assert plan.weights.bytes_per_weight == 0.5625
    assert plan.weights.per_gpu_bytes == 1_072_828_416
    assert plan.weights.tie_word_embeddings
    assert plan.stages[0].lm_head_bytes == 0
    assert plan.fits
    # pp 2: stage 0 = embedding + 8 layers = 525,336,576 + 273,743,872 = 799,080,448; stage 1 = 8 layers
    # + final norm + a copy of the tied table = 273,743,872 + 4,096 + 525,336,576 = 799,084,544.
    pp2 = make_plan(_inputs(llama1b, weight_format="nvfp4", pp=2), GPUS["B200"])
    assert [s.weights_bytes for s in pp2.stages] == [799_080_448, 799_084_544]
    assert pp2.weights.per_gpu_bytes == 799_084_544
    # KV per GPU per token on each stage: 2 × 8 layers × 8 × 64 × 2 = 16,384 (whole model 32,768).
    assert [s.kv_bytes_per_token for s in pp2.stages] == [16_384, 16_384]
    assert pp2.kv_cache.bytes_per_token == 32_768


def test_nvfp4_needs_blackwell(llama1b: dict) -> None:
    plan = make_plan(_inputs(llama1b, weight_format="nvfp4"), GPUS["H100-SXM"])
    assert not plan.fits and plan.first_limit == "format"
    assert "SM 100+" in plan.verdict
    assert any("B200" in a for a in plan.advice)


def test_int8_smoothquant_refused_on_blackwell_and_fp8_on_ampere(llama8b: dict) -> None:
    assert make_plan(_inputs(llama8b, weight_format="int8_sq"), GPUS["B200"]).first_limit == "format"
    a100 = make_plan(_inputs(llama8b, weight_format="fp8"), GPUS["A100-80GB"])
    assert a100.first_limit == "format" and "SM 89+" in a100.verdict
    kv = make_plan(_inputs(llama8b, kv_cache="fp8"), GPUS["A100-80GB"])
    assert kv.first_limit == "format" and "FP8 KV cache needs SM 89+" in kv.verdict


def test_awq_block_size_64(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, weight_format="w4a8_awq", awq_block_size=64), TEST_GPU)
    # 0.5 + 2/64 = 0.53125. Linear params 218,103,808 × 32 = 6,979,321,856 × 0.53125 = 3,707,764,736;
    # embedding and excluded lm_head 2 × 525,336,576 × 2 = 2,101,346,304; norms (32×8192 + 4096) × 2 =
    # 532,480. Total 5,809,643,520.
    assert plan.weights.bytes_per_weight == 0.53125
    assert plan.weights.per_gpu_bytes == 5_809_643_520


def test_int4_wo_is_per_channel_and_lm_head_quantized_when_not_excluded(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, weight_format="int4_wo", exclude_modules=()), TEST_GPU)
    # 0.5 bytes per weight (per-channel scales not counted). Linears 6,979,321,856 × 0.5 = 3,489,660,928;
    # lm_head 525,336,576 × 0.5 = 262,668,288; embedding 1,050,673,152; norms 532,480.
    # Total 3,489,660,928 + 262,668,288 + 1,050,673,152 + 532,480 = 4,803,534,848.
    assert plan.weights.bytes_per_weight == 0.5
    assert plan.weights.per_gpu_bytes == 4_803_534_848
    assert plan.weights.excluded_matches == []


def test_exclude_pattern_keeps_matching_layers_at_base_dtype(llama8b: dict) -> None:
    plan = make_plan(
        _inputs(llama8b, weight_format="fp8", exclude_modules=("lm_head", "*.mlp.down_proj")), TEST_GPU
    )
    # fp8 everywhere (1 byte) except down_proj (4096×14336 = 58,720,256 params per layer at 2 bytes):
    # linears 6,979,321,856 + 32 × 58,720,256 = 6,979,321,856 + 1,879,048,192 = 8,858,370,048;
    # + embedding and lm_head 2,101,346,304 + norms 532,480 = 10,960,248,832.
    assert plan.weights.per_gpu_bytes == 10_960_248_832
    assert plan.weights.excluded_matches == ["lm_head", "model.layers.*.mlp.down_proj"]
    # Excluded bytes: down_proj 32 × 58,720,256 × 2 = 3,758,096,384 + lm_head 1,050,673,152 = 4,808,769,536.
    assert plan.stages[0].excluded_bytes == 4_808_769_536


def test_max_tokens_in_paged_kv_cache_caps_the_budget(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, max_tokens_in_paged_kv_cache=10_000), TEST_GPU)
    # ceil(10,000 / 32) = 313 blocks = 10,016 tokens, below the 14,517 blocks the fraction allows;
    # one 8192-token sequence needs 256 blocks -> 1 sequence.
    assert plan.kv_cache.blocks == 313
    assert plan.kv_cache.tokens == 10_016
    assert plan.kv_cache.limited_by == "max_tokens_in_paged_kv_cache"
    assert plan.kv_cache.max_sequences == 1


# ------------------------------------------------------------------------------------------ roofline


def test_decode_and_prefill_roofline_llama8b_fp8_h100(llama8b: dict) -> None:
    plan = make_plan(
        _inputs(llama8b, weight_format="fp8", kv_cache="fp8", max_seq_len=4096, max_input_len=2048),
        GPUS["H100-SXM"],
    )
    # Bytes read per step: linears 6,979,321,856 (fp8) + norms 532,480 + lm_head (excluded, bf16)
    # 1,050,673,152 = 8,030,527,488 (the embedding is only looked up). KV per sequence at 4096 tokens:
    # 4096 × 65,536 (2×32×8×128×1) = 268,435,456.
    # Batch 1: (8,030,527,488 + 268,435,456) / 3.35e12 B/s = 2.47730 ms -> 403.7 tokens/s.
    first = plan.limits.decode[0]
    assert first.batch == 1
    assert first.bound == "memory"
    assert first.step_ms == pytest.approx(2.47730, rel=1e-5)
    assert first.tokens_per_s_per_sequence == pytest.approx(1000 / 2.47730, rel=1e-5)
    # Batch 64: (8,030,527,488 + 64 × 268,435,456) / 3.35e12 = 25,210,396,672 / 3.35e12 = 7.52549 ms;
    # aggregate 64 / 7.52549 ms = 8,504.4 tokens/s.
    last = plan.limits.decode[-1]
    assert last.batch == 64
    assert last.step_ms == pytest.approx(7.52549, rel=1e-5)
    assert last.tokens_per_s == pytest.approx(64 / 7.52549e-3, rel=1e-5)
    assert [p.batch for p in plan.limits.decode] == [1, 2, 4, 8, 16, 32, 64]
    # Prefill of 2048 tokens: GEMM 2 × 6,979,321,856 × 2048 = 28,587,302,322,176 FLOPs at 1,979 TFLOPS
    # (fp8) = 14.44533 ms; lm_head for the last token 2 × 525,336,576 at 989 (bf16) = 0.00106 ms;
    # attention 2 × 32 layers × 32 heads × 128 × 2048² = 1,099,511,627,776 at 989 = 1.11174 ms.
    # Total 15.55813 ms.
    pre = plan.limits.prefill
    assert pre.gemm_flops == 28_587_302_322_176 + 2 * 525_336_576
    assert pre.attention_flops == 1_099_511_627_776
    assert pre.seconds == pytest.approx(15.55813e-3, rel=1e-5)


def test_decode_becomes_compute_bound_at_large_batch(llama1b: dict) -> None:
    # Llama-3.2-1B bf16 on TEST-80 (2000 GB/s, 1000 TFLOPS), max_seq_len 32 so the KV cache is small.
    # GEMM params: linears 60,817,408 × 16 = 973,078,528 + tied head 262,668,288 = 1,235,746,816.
    # At batch 1024: compute 2 × 1,235,746,816 × 1024 / 1e15 = 2.53081 ms; memory: weights read
    # 973,078,528×2 = 1,946,157,056 + norms (16×4096 + 2048)×2 = 135,168 + tied head table 525,336,576 =
    # 2,471,628,800 bytes; KV (2×16×8×64×2 = 32,768 per token) 1024 × 32 tokens × 32,768 =
    # 1,073,741,824 -> 3,545,370,624 / 2e12 = 1.77269 ms. Compute-bound.
    plan = make_plan(_inputs(llama1b, max_seq_len=32, max_input_len=32, max_batch_size=1024), TEST_GPU)
    point = plan.limits.decode[-1]
    assert point.batch == 1024
    assert point.memory_ms == pytest.approx(1.772685, rel=1e-5)
    assert point.compute_ms == pytest.approx(2.53081, rel=1e-5)
    assert point.bound == "compute"
    assert point.step_ms == pytest.approx(2.53081, rel=1e-5)


# ------------------------------------------------------------------------------------------- verdicts


def test_llama70b_bf16_does_not_fit_one_h100(llama70b: dict) -> None:
    plan = make_plan(_inputs(llama70b), GPUS["H100-SXM"])
    # 70,553,706,496 × 2 bytes = 141,107,412,992 bytes = 131.42 GiB > 79.65 GiB.
    assert plan.weights.per_gpu_bytes == 141_107_412_992
    assert not plan.fits and plan.first_limit == "weights"
    assert "131.42 GiB" in plan.verdict
    assert any(a.startswith("weight format") for a in plan.advice)
    assert any(a.startswith("tp 2") for a in plan.advice)


def test_kv_cache_limit_on_a_small_gpu(llama8b: dict) -> None:
    plan = make_plan(
        _inputs(llama8b, weight_format="int4_awq", max_seq_len=131072, max_batch_size=1), GPUS["RTX-4090"]
    )
    # One 131,072-token sequence needs 131,072 × 131,072 bytes = 16 GiB of bf16 KV cache; a 24 GiB card
    # holding ~5 GiB of int4 weights and ~2 GiB workspace has less than that left.
    assert plan.kv_cache.bytes_per_sequence_per_gpu == 16 * GIB
    assert not plan.fits and plan.first_limit == "kv_cache"
    assert any(a.startswith("max_seq_len ≤") for a in plan.advice)
    assert any(a.startswith("kv_cache fp8") for a in plan.advice)


def test_gpu_count_too_small(llama70b: dict) -> None:
    plan = make_plan(_inputs(llama70b, tp=4), GPUS["H100-SXM"], gpu_count=2)
    assert not plan.fits and plan.first_limit == "gpu_count"
    assert "needs 4 GPUs, 2 given" in plan.verdict
    replicas = make_plan(_inputs(llama70b, weight_format="fp8", tp=2), GPUS["H100-SXM"], gpu_count=8)
    assert replicas.replicas == 4


def test_pipeline_stages_split_layers_evenly(llama70b: dict) -> None:
    plan = make_plan(_inputs(llama70b, pp=3), GPUS["H200"])
    # 80 layers over 3 stages: 27, 27, 26.
    assert [(s.first_layer, s.layers) for s in plan.stages] == [(0, 27), (27, 27), (54, 26)]


def test_fits_verdict_without_limits(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, weight_format="fp8", max_batch_size=8), GPUS["H100-SXM"])
    assert plan.fits and plan.first_limit is None and plan.advice == []
    assert plan.verdict.startswith("fits:")


# ---------------------------------------------------------------------------------------- bad input


def test_unknown_gpu_lists_known_names() -> None:
    with pytest.raises(PlanError, match="unknown GPU 'H300'; known GPUs: .*H100-SXM.*B200"):
        resolve_gpu("H300")
    assert resolve_gpu("h100").name == "H100-SXM"


def test_missing_config_fields_are_named(llama8b: dict) -> None:
    broken = {k: v for k, v in llama8b.items() if k not in ("intermediate_size", "vocab_size")}
    with pytest.raises(PlanError, match=r"missing vocab_size, intermediate_size .*needs: vocab_size, hidden_size"):
        parse_model_config(broken)
    falcon = {k: v for k, v in FALCON_7B.items() if k != "num_hidden_layers"}
    with pytest.raises(PlanError, match=r"missing num_hidden_layers or n_layer"):
        parse_model_config(falcon)


def test_moe_config_is_refused(llama8b: dict) -> None:
    with pytest.raises(PlanError, match="mixture-of-experts"):
        parse_model_config({**llama8b, "num_local_experts": 8})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_format": "int3"}, "unknown weight format 'int3'; known weight formats: none, fp8"),
        ({"kv_cache": "fp4"}, "kv_cache 'fp4' unknown; known values: none, fp8, int8"),
        ({"dtype": "half"}, "unknown dtype 'half'; known dtypes: float16, bfloat16, float32"),
        ({"tp": 0}, "tp must be a positive integer"),
        ({"kv_cache_free_gpu_mem_fraction": 1.5}, r"must be in \(0, 1\]"),
        ({"weight_format": "int4_awq", "awq_block_size": 32}, "awq_block_size must be 64 or 128"),
        ({"pp": 33}, "pp 33 exceeds the model's 32 layers"),
        ({"tp": 3}, r"valid tp sizes for this model: \[1, 2, 4, 8, 16, 32\]"),
    ],
)
def test_bad_inputs_explain_what_is_allowed(llama8b: dict, change: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(_inputs(llama8b, **change), TEST_GPU)


def test_load_model_config_from_dir_and_file(tmp_path: Path, llama1b: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(llama1b))
    assert load_model_config(tmp_path)["hidden_size"] == 2048
    assert load_model_config(tmp_path / "config.json")["num_hidden_layers"] == 16
    with pytest.raises(PlanError, match="model config not found"):
        load_model_config(tmp_path / "nope")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="not a readable JSON model config"):
        load_model_config(tmp_path / "bad.json")
    (tmp_path / "partial.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PlanError, match="partial.json: model config is missing vocab_size"):
        load_model_config(tmp_path / "partial.json")


def test_shipped_configs() -> None:
    assert shipped_model_config("hf:meta-llama/Llama-3.1-8B-Instruct@5206a32")["hidden_size"] == 4096
    assert shipped_model_config("META-LLAMA/llama-3.1-70b-instruct")["num_hidden_layers"] == 80
    assert shipped_model_config("hf:meta-llama/Llama-3.2-1B")["tie_word_embeddings"] is True
    assert shipped_model_config("hf:someone/unknown-model") is None
    assert "meta-llama/llama-3.1-8b-instruct" in shipped_model_ids()
    # Each call returns a fresh copy.
    first = shipped_model_config("hf:meta-llama/Llama-3.2-1B-Instruct")
    first["hidden_size"] = 1
    assert shipped_model_config("hf:meta-llama/Llama-3.2-1B-Instruct")["hidden_size"] == 2048


# ------------------------------------------------------------------------------------------- output


def test_json_output_is_serialisable_with_bases(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, weight_format="int4_awq"), GPUS["L40S"])
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["gpu"]["name"] == "L40S"
    assert data["weights"]["quant_algo"] == "W4A16_AWQ"
    assert "0.515625" in data["weights"]["basis"][0]
    for section in ("workspace", "kv_cache"):
        assert data[section]["basis"]
    assert data["limits"]["decode_basis"] and data["limits"]["prefill"]["basis"]
    assert "model_config" not in data["settings"]
    assert data["fits"] is plan.fits and data["verdict"] == plan.verdict


def test_render_prints_the_tables_and_verdict(llama70b: dict) -> None:
    plan = make_plan(_inputs(llama70b), GPUS["H100-SXM"])
    buffer = io.StringIO()
    render_plan(plan, Console(file=buffer, width=160, color_system=None))
    text = buffer.getvalue()
    for expected in ("Weights", "KV cache", "Limits", "Verdict:", "131.42 GiB", "tp 2"):
        assert expected in text


def test_workspace_limit_suggests_fewer_tokens_per_pass(llama8b: dict) -> None:
    plan = make_plan(_inputs(llama8b, dtype="float16", max_num_tokens=65_536, max_batch_size=4), GPUS["L4"])
    # Activations 131,072 bytes per token × 65,536 tokens = 8 GiB; + 1 GiB runtime + logits 4 × 128256 × 4
    # = 2,052,096 bytes; with 16,060,522,496 bytes (14.96 GiB) of fp16 weights that exceeds the L4's
    # 22.49 GiB (23,034 MiB).
    assert plan.workspace.activation_bytes == 8 * GIB
    assert plan.workspace.total_bytes == 9 * GIB + 2_052_096
    assert not plan.fits and plan.first_limit == "workspace"
    # At max_num_tokens 16,384 activations are 2 GiB and it fits.
    assert any(a.startswith("max_num_tokens 16384: activations 2.00 GiB") for a in plan.advice)


def test_memory_figures_for_70b_as_the_speed_work_left_them(llama70b: dict) -> None:
    # Llama 70B: per layer q, o 8192×8192 = 67,108,864 each; k, v 8192×1024 = 8,388,608 each; MLP 3 × 8192 ×
    # 28672 = 704,643,072; norms 2 × 8192 -> 855,654,400; × 80 = 68,452,352,000; embedding and lm_head
    # 128256 × 8192 = 1,050,673,152 each; final norm 8192 -> 70,553,706,496 params.
    fp16 = make_plan(_inputs(llama70b, dtype="float16"), TEST_GPU)
    assert fp16.weights.total_params == 70_553_706_496
    assert fp16.weights.total_bytes == 141_107_412_992  # × 2 bytes ≈ 140 GB
    # INT4 AWQ: the decoder layers at 0.515625 bytes per weight ≈ 35 GB; embedding and the excluded lm_head
    # stay at 2 bytes (4.2 GB): (855,654,400 − 16,384) × 0.515625 + 32,768 = 441,221,120 per layer × 80 =
    # 35,297,689,600; total 35,297,689,600 + 4,202,692,608 + 16,384 = 39,500,398,592.
    awq = make_plan(_inputs(llama70b, weight_format="int4_awq", dtype="float16"), TEST_GPU)
    assert awq.stages[0].attention_bytes + awq.stages[0].mlp_bytes + 80 * 32_768 == 35_297_689_600
    assert awq.weights.total_bytes == 39_500_398_592
    # Full multi-head attention (64 KV heads), fp16 KV: 2 × 80 layers × 8192 × 2 B = 2,621,440 B ≈ 2.6 MB per
    # token; a 4,096-token sequence: 2,621,440 × 4096 = 10,737,418,240 B ≈ 10.7 GB.
    mha = make_plan(_inputs({**llama70b, "num_key_value_heads": 64}, dtype="float16", max_seq_len=4096), TEST_GPU)
    assert mha.kv_cache.bytes_per_token == 2_621_440
    assert mha.kv_cache.bytes_per_sequence_per_gpu == 10_737_418_240
