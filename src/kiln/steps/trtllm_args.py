"""What ``trtllm-build`` 1.2.1 is asked to build and what the engine it writes must say, from a recipe.

Pure functions (no TensorRT-LLM, no I/O): every ``engine`` field of the recipe maps to one flag (checked against
upstream's flag list in :mod:`kiln.steps.trtllm_flags`), and the engine's ``config.json`` is read back against the
recipe. ``--logits_dtype float32`` is always passed: kiln's Triton configs declare the logits tensors FP32 (the
type every upstream example fills), and a ModelOpt checkpoint otherwise hands the engine float16 logits, which
the backend's tensors would contradict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from kiln.recipe.schema import Recipe
from kiln.triton.repository import LOGITS_DTYPE
from kiln.util.dotted import dotted_get



def _on_off(flag: bool) -> str:
    return "enable" if flag else "disable"


def engine_max_seq_len(recipe: Recipe, resolved_max_seq_len: Optional[int]) -> Optional[int]:
    """max_seq_len the engine will report: the recipe's (or the model's) plus max_draft_len (upstream adds it)."""
    base = recipe.engine.max_seq_len or resolved_max_seq_len
    return None if base is None else base + recipe.engine.speculative.max_draft_len


def trtllm_build_args(recipe: Recipe, checkpoint_dir: Path | str, output_dir: Path | str) -> list[str]:
    """The exact `trtllm-build` argument list for a recipe (without the program name)."""
    b = recipe.engine
    args = [
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(output_dir),
        "--max_batch_size", str(b.max_batch_size),
        "--max_input_len", str(b.max_input_len),
    ]
    if b.max_seq_len is not None:
        args += ["--max_seq_len", str(b.max_seq_len)]
    args += [
        "--max_num_tokens", str(b.max_num_tokens),
        "--max_beam_width", str(b.max_beam_width),
        "--kv_cache_type", b.kv_cache_type,
        "--tokens_per_block", str(b.tokens_per_block),
        "--gemm_plugin", b.gemm_plugin,
        "--context_fmha", _on_off(b.context_fmha),
        "--use_paged_context_fmha", _on_off(b.use_paged_context_fmha),
        "--use_fp8_context_fmha", _on_off(b.use_fp8_context_fmha),
        "--remove_input_padding", _on_off(b.remove_input_padding),
        "--multiple_profiles", _on_off(b.multiple_profiles),
        "--workers", str(b.workers or recipe.parallelism.tp * recipe.parallelism.pp),
    ]
    args += ["--logits_dtype", LOGITS_DTYPE]
    if b.gather_context_logits:  # a store_true flag: absent is off
        args.append("--gather_context_logits")
    if b.speculative.mode != "none":
        args += ["--speculative_decoding_mode", b.speculative.mode, "--max_draft_len", str(b.speculative.max_draft_len)]
    return args


def expected_engine_config(recipe: Recipe, resolved_max_seq_len: Optional[int]) -> dict[str, Any]:
    """What the engine's config.json must say (build_config / plugin_config keys as TensorRT-LLM 1.2 writes them)."""
    b = recipe.engine
    want: dict[str, Any] = {
        "build_config.max_batch_size": b.max_batch_size,
        "build_config.max_input_len": b.max_input_len,
        "build_config.max_num_tokens": b.max_num_tokens,
        "build_config.max_beam_width": b.max_beam_width,
        "build_config.plugin_config.tokens_per_block": b.tokens_per_block,
        "build_config.plugin_config.context_fmha": b.context_fmha,
        "build_config.plugin_config.use_paged_context_fmha": b.use_paged_context_fmha,
        "build_config.plugin_config.remove_input_padding": b.remove_input_padding,
        "build_config.kv_cache_type": b.kv_cache_type.upper(),
        "pretrained_config.mapping.tp_size": recipe.parallelism.tp,
        "pretrained_config.mapping.pp_size": recipe.parallelism.pp,
        "pretrained_config.logits_dtype": LOGITS_DTYPE,
        "build_config.gather_context_logits": b.gather_context_logits,
    }
    seq = engine_max_seq_len(recipe, resolved_max_seq_len)
    if seq is not None:
        want["build_config.max_seq_len"] = seq
    if b.speculative.mode != "none":
        want["build_config.max_draft_len"] = b.speculative.max_draft_len
    return want


_MISSING = object()


def _same(want: Any, got: Any) -> bool:
    if isinstance(want, str) and isinstance(got, str):
        return want.lower() == got.lower() or got.upper().endswith("." + want.upper())
    return want == got


def verify_engine_config(recipe: Recipe, engine_cfg: dict, resolved_max_seq_len: Optional[int]) -> list[str]:
    """Differences between the built engine's config.json and the recipe (empty list: they agree)."""
    problems = []
    for key, want in expected_engine_config(recipe, resolved_max_seq_len).items():
        got = dotted_get(engine_cfg, key, _MISSING)
        if got is _MISSING:
            problems.append(f"{key}: missing from the engine config (recipe wants {want!r})")
        elif not _same(want, got):
            problems.append(f"{key}: engine has {got!r}, recipe wants {want!r}")
    return problems
