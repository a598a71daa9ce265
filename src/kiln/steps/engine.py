"""Build: compile the TensorRT-LLM 1.2.x engine from the quantize step's checkpoint (`target: tensorrt`).

Every build field of the recipe maps to one `trtllm-build` flag (checked against the 1.2 flag list in
:mod:`kiln.steps.trtllm_flags`). The step refuses, before any work, where the engine cannot be built: no
`tensorrt_llm`, no CUDA device, or a GPU whose architecture cannot run the format. After the build it reads the
engine's `config.json` and fails if it disagrees with the recipe. For `target: reference` there is no engine:
the step records that the CPU reference runtime will serve the quantized checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, Optional

from kiln.recipe.gpus import detect_gpus, lookup_gpu
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.formats import format_refusal, kv_refusal
from kiln.recipe.schema import Recipe
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.steps.resolve import ResolveResult
from kiln.util.errors import KilnError

CHECKPOINT_SUBDIR = "trtllm_checkpoint"  # inside the quantize step's output
ENGINE_SUBDIR = "trtllm_engine"
REFERENCE_NOTE = ("target 'reference': no engine is compiled; the CPU reference runtime (PyTorch in a Triton "
                  "Python model, tensorrt_llm tensor contract) serves the quantized checkpoint — a test and "
                  "development vehicle, not the fast path")
HOW_TO_PROCEED = ("build on a GPU host with TensorRT-LLM 1.2.x (pip install tensorrt_llm==1.2.1, or inside the "
                  "NGC container nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3), or set target: reference "
                  "to serve on CPU for testing")


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
    if b.speculative.mode != "none":
        args += ["--speculative_decoding_mode", b.speculative.mode, "--max_draft_len", str(b.speculative.max_draft_len)]
    return args


def build_command(recipe: Recipe, checkpoint_dir: Path | str, output_dir: Path | str) -> list[str]:
    exe = shutil.which("trtllm-build") or "trtllm-build"
    return [exe, *trtllm_build_args(recipe, checkpoint_dir, output_dir)]


def why_not_buildable(recipe: Recipe) -> Optional[str]:
    """Why the engine cannot be built on this machine, or None. Cheap: no import of tensorrt_llm or torch."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return f"TensorRT-LLM is not installed here (no `tensorrt_llm` module). To proceed: {HOW_TO_PROCEED}."
    detected = detect_gpus()
    if detected is None and not _cuda_available():
        return f"no CUDA device found on this machine. To proceed: {HOW_TO_PROCEED}."
    gpu = lookup_gpu(detected[0]) if detected else None
    q = recipe.quantization
    if gpu is not None:
        refusal = (format_refusal(q.format, recipe.target, gpu.sm, gpu.name)
                   or kv_refusal(q.kv_cache, recipe.target, gpu.sm, gpu.name))
        if refusal is not None:
            return f"on this machine's GPU: {refusal.reason}. To proceed: {refusal.hint}"
        if recipe.hardware.gpu and lookup_gpu(recipe.hardware.gpu) is not gpu:
            return (f"the recipe targets {recipe.hardware.gpu} but this machine has {gpu.name}: an engine is built "
                    f"for one GPU architecture. Build on a {recipe.hardware.gpu}, or set hardware.gpu: {gpu.name}")
    return None


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


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
    }
    seq = engine_max_seq_len(recipe, resolved_max_seq_len)
    if seq is not None:
        want["build_config.max_seq_len"] = seq
    if b.speculative.mode != "none":
        want["build_config.max_draft_len"] = b.speculative.max_draft_len
    return want


def _lookup(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _same(want: Any, got: Any) -> bool:
    if isinstance(want, str) and isinstance(got, str):
        return want.lower() == got.lower() or got.upper().endswith("." + want.upper())
    return want == got


def verify_engine_config(recipe: Recipe, engine_cfg: dict, resolved_max_seq_len: Optional[int]) -> list[str]:
    """Differences between the built engine's config.json and the recipe (empty list: they agree)."""
    problems = []
    for key, want in expected_engine_config(recipe, resolved_max_seq_len).items():
        got = _lookup(engine_cfg, key)
        if got is _MISSING:
            problems.append(f"{key}: missing from the engine config (recipe wants {want!r})")
        elif not _same(want, got):
            problems.append(f"{key}: engine has {got!r}, recipe wants {want!r}")
    return problems


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("tensorrt_llm", "tensorrt"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    return out


class EngineResult(StepResult):
    """Which runtime serves the model, and for a TensorRT-LLM engine the versions it was built with (an engine
    only loads in a container with the same TensorRT-LLM and TensorRT)."""

    runtime: Literal["reference", "tensorrt"]
    tensorrt_llm: Optional[str] = None
    tensorrt: Optional[str] = None


def build_engine(ctx: StepContext) -> EngineResult:
    r = ctx.recipe
    if r.target == "reference":
        (ctx.out_dir / "engine.json").write_text(json.dumps({"runtime": "reference", "note": REFERENCE_NOTE}, indent=2))
        return EngineResult(summary="no engine (reference target: the CPU reference runtime serves the checkpoint)",
                            runtime="reference")
    reason = why_not_buildable(r)
    if reason is not None:
        raise KilnError(f"cannot build the TensorRT engine: {reason}")
    checkpoint = ctx.inputs["quantize"] / CHECKPOINT_SUBDIR
    engine_dir = ctx.out_dir / ENGINE_SUBDIR
    cmd = build_command(r, checkpoint, engine_dir)
    from kiln.steps.trtllm_flags import check_flags

    bad = check_flags(cmd[1:])
    if bad:
        raise KilnError("kiln produced flags TensorRT-LLM 1.2 does not accept: " + "; ".join(bad))
    log = ctx.out_dir / "trtllm-build.log"
    ctx.log("  " + shlex.join(cmd))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with ctx.status("trtllm-build (minutes)"), open(log, "w") as fh:
        proc = subprocess.run(cmd if shutil.which(cmd[0]) else
                              [sys.executable, "-m", "tensorrt_llm.commands.engine", *cmd[1:]],
                              stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise KilnError(f"trtllm-build failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    engine_cfg = json.loads((engine_dir / "config.json").read_text())
    resolved_seq = ctx.result(ResolveResult).max_seq_len
    mismatches = verify_engine_config(r, engine_cfg, resolved_seq)
    if mismatches:
        raise KilnError("the engine does not match the recipe:\n  " + "\n  ".join(mismatches))
    ranks = r.parallelism.tp * r.parallelism.pp
    missing = [f"rank{i}.engine" for i in range(ranks) if not (engine_dir / f"rank{i}.engine").is_file()]
    if missing:
        raise KilnError(f"trtllm-build did not write {', '.join(missing)}")
    versions = _versions()
    (ctx.out_dir / "engine.json").write_text(json.dumps({"runtime": "tensorrt", **versions,
                                                         "command": cmd}, indent=2))
    return EngineResult(summary=f"engine built with TensorRT-LLM {versions['tensorrt_llm']}", runtime="tensorrt",
                        **versions)


def describe(loaded: LoadedRecipe) -> list[str]:
    r = loaded.recipe
    if r.target == "reference":
        return [REFERENCE_NOTE]
    lines = ["$ " + shlex.join(build_command(r, f"build/{r.name}/quantize/{CHECKPOINT_SUBDIR}",
                                             f"build/{r.name}/engine/{ENGINE_SUBDIR}"))]
    reason = why_not_buildable(r)
    if reason:
        lines.append(f"(will stop here on this machine: {reason})")
    return lines


def required_files(recipe: Recipe) -> tuple[str, ...]:
    """engine.json always; for target tensorrt also the engine's config.json and one engine file per rank."""
    if recipe.target != "tensorrt":
        return ("engine.json",)
    ranks = recipe.parallelism.tp * recipe.parallelism.pp
    return ("engine.json", f"{ENGINE_SUBDIR}/config.json") + tuple(f"{ENGINE_SUBDIR}/rank{r}.engine"
                                                                    for r in range(ranks))


SPEC = StepSpec(
    name="engine",
    fn=build_engine,
    result=EngineResult,
    keys=("engine", "parallelism", "target", "hardware.gpu"),
    files=required_files,
    after=("resolve", "quantize"),
    tools=("tensorrt_llm", "tensorrt"),
    gpu_dependent=lambda recipe: recipe.target == "tensorrt",
    describe=describe,
)
