"""The evaluate step: how much quality quantization cost, and the gate that stops a bad build.

It loads the unquantized model (``checkpoint/`` of the quantize step) and the quantized one (the same
checkpoint with ``modelopt_state.pth`` restored onto it: exactly what the reference runtime serves and
what the TensorRT-LLM checkpoint encodes), runs both over the evaluation text and measures

- perplexity of each (token-weighted over all sequences) and its relative increase;
- the mean per-token KL divergence KL(base ‖ quantized), in nats: how far the quantized model's
  next-token distribution drifts from the original, including on tokens both get wrong.

The figures go to ``quality.json`` and a table. The gate thresholds (``evaluation.max_ppl_increase_pct``,
``evaluation.max_kl``) are deliberately outside the step's fingerprint: changing a threshold re-checks
the stored figures with :func:`check_gate` instead of re-running the measurement.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from pathlib import Path
from typing import Any, Optional

from kiln.models.data import batches, content_hash, load_texts, tokenize_samples
from kiln.models.loading import load_model, load_tokenizer, read_config, resolve_dtype
from kiln.plan.workers import eval_batch_size
from kiln.recipe.formats import gentler_alternatives
from kiln.recipe.gpus import lookup_gpu
from kiln.recipe.loader import LoadedRecipe
from kiln.recipe.schema import Recipe, quantization_runtime
from kiln.runtime.workers.evaluate import nll_and_kl
from kiln.steps.base import Gate, StepContext, StepResult, StepSpec
from kiln.steps.quantize import CHECKPOINT_DIR, MODELOPT_STATE, QUANT_RECORD, RESTORE_CHECK, quiet_stdout
from kiln.steps.runtime_jobs import runtime_identity
from kiln.util.errors import KilnError

QUALITY_FILE = "quality.json"


class EvaluateResult(StepResult):
    """The quality figures (absent when evaluation is off): perplexity of both models, its relative increase,
    and the mean per-token KL divergence."""

    skipped: bool = False
    format: Optional[str] = None
    kv_cache: Optional[str] = None
    dataset: Optional[str] = None
    samples: Optional[int] = None
    tokens: Optional[int] = None
    base_perplexity: Optional[float] = None
    quant_perplexity: Optional[float] = None
    ppl_increase_pct: Optional[float] = None
    mean_kl: Optional[float] = None
    seconds: Optional[float] = None
    graded_in: Optional[str] = None
    """`host`, or the engine runtime (and its device) that graded the quantizers it calibrated."""

    def figures(self) -> dict:
        """The measured figures (no summary, nothing unset): what kiln.json and sweep tables show."""
        return self.model_dump(exclude={"summary", "skipped"}, exclude_none=True)


def evaluate_input_hashes(loaded: LoadedRecipe) -> dict[str, str]:
    ev = loaded.recipe.evaluation
    return {"evaluation": content_hash(ev, "evaluation")} if ev.enabled else {}


def quality_gates(recipe: Recipe, result: EvaluateResult) -> list[Gate]:
    """The quality gate's criteria with their figures: the perplexity increase and the mean KL divergence, each
    against its threshold (passed None when the threshold is off or evaluation did not run)."""
    ev = recipe.evaluation
    pct, kl = result.ppl_increase_pct, result.mean_kl
    fmt = result.format or recipe.quantization.format
    advice = f"pick a gentler format{_gentler(recipe, fmt)}"
    if result.skipped or pct is None:
        ppl = Gate("perplexity increase", "evaluation.max_ppl_increase_pct", None, "no figure (evaluation did not run)")
    elif ev.max_ppl_increase_pct is None:
        ppl = Gate("perplexity increase", "evaluation.max_ppl_increase_pct", None,
                   f"perplexity rose {_pct(pct)}%; gate off (evaluation.max_ppl_increase_pct empty)")
    elif pct > ev.max_ppl_increase_pct:
        ppl = Gate("perplexity increase", "evaluation.max_ppl_increase_pct", False,
                   f"perplexity rose {_pct(pct)}% ({result.base_perplexity:.2f} → {result.quant_perplexity:.2f}), "
                   f"gate is {ev.max_ppl_increase_pct:g}%: raise evaluation.max_ppl_increase_pct or {advice}")
    else:
        ppl = Gate("perplexity increase", "evaluation.max_ppl_increase_pct", True,
                   f"perplexity rose {_pct(pct)}% ({result.base_perplexity:.2f} → {result.quant_perplexity:.2f}), "
                   f"gate is {ev.max_ppl_increase_pct:g}%")
    if result.skipped or kl is None:
        kl_gate = Gate("mean KL divergence", "evaluation.max_kl", None, "no figure (evaluation did not run)")
    elif ev.max_kl is None:
        kl_gate = Gate("mean KL divergence", "evaluation.max_kl", None,
                       f"mean KL divergence is {kl:.4g} nats per token; gate off (evaluation.max_kl empty)")
    elif kl > ev.max_kl:
        kl_gate = Gate("mean KL divergence", "evaluation.max_kl", False,
                       f"mean KL divergence is {kl:.4g} nats per token, gate is {ev.max_kl:g}: "
                       f"raise evaluation.max_kl or {advice}")
    else:
        kl_gate = Gate("mean KL divergence", "evaluation.max_kl", True,
                       f"mean KL divergence is {kl:.4g} nats per token, gate is {ev.max_kl:g}")
    return [ppl, kl_gate]


def check_gate(recipe: Recipe, result: EvaluateResult) -> Optional[str]:
    """A message when the stored evaluation figures fail the recipe's quality gate, else None."""
    return "; ".join(g.message for g in quality_gates(recipe, result) if g.passed is False) or None


def _gentler(recipe: Recipe, fmt: str) -> str:
    """" (e.g. X or Y)": the registry's gentler formats that run on the recipe's target and GPU ("" if none)."""
    gpu = lookup_gpu(recipe.hardware.gpu) if recipe.hardware.gpu else None
    try:
        names = gentler_alternatives(fmt, recipe.target, gpu.sm if gpu else None)
    except LookupError:  # a format from an older registry in stored figures
        names = []
    return f" (e.g. {' or '.join(names[:2])})" if names else ""


def _pct(value: float) -> str:
    """23.39 → "23.4", 0.1595 → "0.16": enough digits to compare with a small gate."""
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.2g}"


def _write_quality(out_dir: Path, data: dict) -> None:
    (out_dir / QUALITY_FILE).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _restored(ckpt: Path, dtype: str, trust_remote_code: bool) -> Any:
    import modelopt.torch.opt as mto

    model = load_model(ckpt, dtype, trust_remote_code)
    try:
        with quiet_stdout():
            return mto.restore(model, str(ckpt / MODELOPT_STATE)).eval()
    except Exception as exc:  # noqa: BLE001 - a damaged state file: say which
        raise KilnError(f"cannot restore the quantized model from {ckpt / MODELOPT_STATE}: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
                        "re-run the quantize step (kiln build RECIPE --from quantize)") from exc


def _check_restore(model: Any, check_file: Path) -> None:
    """The restored model must reproduce the calibrated model's probe logits."""
    import torch
    from safetensors.torch import load_file

    if not check_file.is_file():
        return
    probe = load_file(str(check_file))
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"].to(device), use_cache=False).logits.float().cpu()
    want = probe["logits"]
    scale = max(1.0, float(want.abs().max()))
    diff = float((logits - want).abs().max())
    if diff > 1e-3 * scale:
        raise KilnError(f"the restored quantized model does not reproduce the calibrated one (max logit difference "
                        f"{diff:.3g}); the quantize output in {check_file.parent} is damaged or was made by "
                        "another ModelOpt/torch version: re-run the quantize step")


def evaluate(ctx: StepContext) -> EvaluateResult:
    """Measure perplexity and KL of the quantized model against the unquantized one; write quality.json."""
    started = time.perf_counter()
    recipe = ctx.recipe
    ev = recipe.evaluation
    out = Path(ctx.out_dir)
    if not ev.enabled:
        _write_quality(out, {"skipped": True, "reason": "evaluation.enabled is false"})
        ctx.log("  evaluation skipped (evaluation.enabled: false): no quality gate")
        return EvaluateResult(summary="evaluation off (evaluation.enabled: false): no quality gate", skipped=True)

    quant_dir = ctx.inputs.get("quantize")
    if quant_dir is None:
        raise KilnError("the evaluate step needs the quantize step's output; run the quantize step first")
    ckpt = Path(quant_dir) / CHECKPOINT_DIR
    for needed in ("config.json", MODELOPT_STATE):
        if not (ckpt / needed).is_file():
            raise KilnError(f"{ckpt / needed} is missing: the quantize output is incomplete; re-run the quantize step")
    record = {}
    if (ckpt / QUANT_RECORD).is_file():
        record = json.loads((ckpt / QUANT_RECORD).read_text(encoding="utf-8"))
    fmt = record.get("format", recipe.quantization.format)
    kv = record.get("kv_cache", recipe.quantization.kv_cache)

    # cheap first: data problems are input errors, reported before any model loads
    trust = recipe.model.trust_remote_code
    tokenizer = load_tokenizer(ckpt, trust)
    texts = load_texts(ev, "evaluation")
    seqs = tokenize_samples(texts, tokenizer, ev.samples, ev.max_seq_len, seed=None, key="evaluation", min_tokens=2)

    dtype = resolve_dtype("auto", read_config(ckpt))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vocab = int(read_config(ckpt).get("vocab_size") or 32000)
    batch_size = eval_batch_size(ev.max_seq_len, vocab)
    if quantization_runtime(recipe) == "engine":
        nll_b, nll_q, kl_sum, tokens, where = _sums_in_runtime(ctx, Path(quant_dir), seqs, dtype, batch_size, pad_id)
    else:
        nll_b, nll_q, kl_sum, tokens = _sums_on_host(ctx, Path(quant_dir), seqs, dtype, batch_size, pad_id)
        where = "host"
    if tokens == 0:
        raise KilnError("the evaluation text gave no tokens to predict")
    ppl_b, ppl_q = math.exp(nll_b / tokens), math.exp(nll_q / tokens)
    figures = {
        "format": fmt, "kv_cache": kv, "dataset": ev.dataset, "samples": len(seqs), "tokens": tokens,
        "base_perplexity": round(ppl_b, 6), "quant_perplexity": round(ppl_q, 6),
        "ppl_increase_pct": round((ppl_q / ppl_b - 1.0) * 100.0, 4),
        "mean_kl": round(kl_sum / tokens, 8),
        "seconds": round(time.perf_counter() - started, 3),
        "graded_in": where,
    }
    _write_quality(out, {"skipped": False, **figures,
                         "gate": {"max_ppl_increase_pct": ev.max_ppl_increase_pct, "max_kl": ev.max_kl}})
    _print_table(ctx, figures, recipe)
    summary = (f"ppl {figures['base_perplexity']:.3f} → {figures['quant_perplexity']:.3f} "
               f"({figures['ppl_increase_pct']:+.2f}%), KL {figures['mean_kl']:.5f}"
               + ("" if where == "host" else f" (graded in {where})"))
    return EvaluateResult(summary=summary, **figures)


def _sums_on_host(ctx: StepContext, quant_dir: Path, seqs: list, dtype: str, batch_size: int,
                  pad_id: int) -> tuple[float, float, float, int]:
    """The evaluation sums with kiln's own ModelOpt (the checkpoint was quantized on the host)."""
    import torch

    trust = ctx.recipe.model.trust_remote_code
    ckpt = quant_dir / CHECKPOINT_DIR
    with ctx.status("loading the unquantized and quantized models"):
        base = load_model(ckpt, dtype, trust)
        quant = _restored(ckpt, dtype, trust)
        _check_restore(quant, Path(quant_dir) / RESTORE_CHECK)

    device = next(base.parameters()).device
    nll_b = nll_q = kl_sum = 0.0
    tokens = 0
    batch_list = batches(seqs, batch_size, pad_id)
    with torch.no_grad():
        for batch in ctx.track(batch_list, "evaluating", total=len(batch_list)):
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            lb = base(input_ids=ids, attention_mask=mask, use_cache=False).logits
            lq = quant(input_ids=ids, attention_mask=mask, use_cache=False).logits
            b, q, k, n = nll_and_kl(lb, lq, ids, mask)
            nll_b, nll_q, kl_sum, tokens = nll_b + b, nll_q + q, kl_sum + k, tokens + n
    del base, quant
    return nll_b, nll_q, kl_sum, tokens


def _sums_in_runtime(ctx: StepContext, quant_dir: Path, seqs: list, dtype: str, batch_size: int,
                     pad_id: int) -> tuple[float, float, float, int, str]:
    """The evaluation sums from the evaluate worker in the engine runtime: the quantizers the runtime's ModelOpt
    calibrated are graded by that same ModelOpt."""
    from kiln.runtime.engine_runtime import engine_runtime_for
    from kiln.steps.runtime_jobs import (evaluate_job, evaluate_job_file, evaluate_mounts, worker_placement,
                                         write_job_file)

    out = Path(ctx.out_dir)
    rt = engine_runtime_for(ctx.recipe, ctx.build_root)
    job = evaluate_job(rt, evaluate_mounts(quant_dir, out))
    job_dir = out / "job"
    write_job_file(job_dir, "evaluate", evaluate_job_file(rt.paths(job), dtype, batch_size, pad_id,
                                                          worker_placement(ctx.loaded)))
    (job_dir / "sequences.json").write_text(json.dumps([[int(t) for t in s] for s in seqs]), encoding="utf-8")
    ctx.log("  " + shlex.join(rt.command(job)))
    with ctx.status("evaluating in the engine runtime") as update:
        rt.run(job, out / "logs" / "evaluate.log", update)
    try:
        report = json.loads((job_dir / "evaluate.result.json").read_text())
    except (OSError, ValueError) as exc:
        raise KilnError(f"the evaluate worker wrote no report ({exc}); see {out / 'logs' / 'evaluate.log'}") from None
    return (float(report["nll_base"]), float(report["nll_quant"]), float(report["kl"]), int(report["tokens"]),
            f"{rt.describe()} ({report.get('device')})")


def describe(loaded: LoadedRecipe, build_root: Path = Path("build")) -> list[str]:
    """--dry-run: where the quality gate's figures are measured (in the engine runtime: the exact command)."""
    r = loaded.recipe
    if not r.evaluation.enabled:
        return ["evaluation off: no quality gate"]
    if quantization_runtime(r) != "engine":
        return [f"perplexity and KL on {r.evaluation.samples} sequences of {r.evaluation.dataset}, with kiln's ModelOpt"]
    from kiln.runtime.engine_runtime import engine_runtime_for
    from kiln.steps.runtime_jobs import evaluate_job, evaluate_mounts

    rt = engine_runtime_for(r, build_root)
    base = build_root / r.name
    job = evaluate_job(rt, evaluate_mounts(base / "quantize", base / "evaluate"))
    return ["$ " + shlex.join(rt.command(job))]


def _print_table(ctx: StepContext, f: dict, recipe: Recipe) -> None:
    from rich.table import Table

    ev = recipe.evaluation
    table = Table(title=f"quality: {f['format']}" + (f" + {f['kv_cache']} KV" if f["kv_cache"] != "none" else "")
                  + f" on {f['samples']} sequences, {f['tokens']} tokens", title_justify="left")
    table.add_column("measure")
    table.add_column("unquantized", justify="right")
    table.add_column("quantized", justify="right")
    table.add_column("change", justify="right")
    table.add_column("gate", justify="right")
    pct_gate = f"≤ {ev.max_ppl_increase_pct:g}%" if ev.max_ppl_increase_pct is not None else "-"
    kl_gate = f"≤ {ev.max_kl:g}" if ev.max_kl is not None else "-"
    table.add_row("perplexity", f"{f['base_perplexity']:.3f}", f"{f['quant_perplexity']:.3f}",
                  f"{f['ppl_increase_pct']:+.2f}%", pct_gate)
    table.add_row("mean KL (nats/token)", "0", f"{f['mean_kl']:.5f}", "", kl_gate)
    ctx.console.print(table)


SPEC = StepSpec(
    name="evaluate",
    fn=evaluate,
    result=EvaluateResult,
    keys=("evaluation",),
    ignore=("evaluation.max_ppl_increase_pct", "evaluation.max_kl", "evaluation.tasks", "evaluation.task_defaults"),
    after=("quantize",),
    tools=("nvidia-modelopt", "torch", "transformers"),
    input_hashes=evaluate_input_hashes,
    runtime=runtime_identity("evaluate"),
    describe=describe,
    files=(QUALITY_FILE,),
    check=check_gate,
    gates=quality_gates,
)
