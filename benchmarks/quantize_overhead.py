"""How much time kiln's quantize step adds over the ModelOpt calls it makes (target: ≤ 1.10×).

Both sides quantize the built-in tiny Llama with the same recipe values on the same calibration text and
write the same artifacts (an HF checkpoint with the tokenizer, ``modelopt_state.pth``, and a TensorRT-LLM
checkpoint). The bare side is what a user would write by hand with ModelOpt; kiln's side is the step
function, with its checks, data validation, restore probe and exported-config verification. Runs
alternate in one process after a warm-up (imports and first-call costs excluded from both), and the
median of 5 is compared, in wall time and in this process's CPU time (steadier on a busy machine).

    python benchmarks/quantize_overhead.py [--format int4_awq] [--runs 5] [--target tensorrt] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def timed(fn: Any, *args: Any) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all threads) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - w0, time.process_time() - c0


def kiln_run(loaded: Any, out: Path) -> None:
    from kiln.steps.base import StepContext
    from kiln.steps.quantize import quantize

    out.mkdir(parents=True)
    quantize(StepContext(loaded, out, show_progress=False))


def bare_run(loaded: Any, model_dir: Path, out: Path) -> None:
    """The same ModelOpt calls, written plainly (upstream quantize.py style), on the same data."""
    import contextlib
    import io

    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.models.tiny import calibration_texts
    from kiln.recipe.formats import kv_cache_format, weight_format

    r = loaded.recipe
    q, c = r.quantization, r.quantization.calibration
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    fmt, kv = weight_format(q.format), kv_cache_format(q.kv_cache)
    n = min(c.samples, fmt.calibration.max_samples or c.samples)
    texts = calibration_texts()[:n]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, r.model.dtype)).eval()
    model.save_pretrained(str(out / "checkpoint"))
    tok.save_pretrained(str(out / "checkpoint"))
    cfg = copy.deepcopy(getattr(mtq, str(fmt.modelopt_config)))
    if fmt.uses_awq_block_size:
        for e in cfg["quant_cfg"]:
            if e.get("quantizer_name") == "*weight_quantizer":
                attrs = e["cfg"][0] if isinstance(e["cfg"], list) else e["cfg"]
                attrs["block_sizes"][-1] = q.awq_block_size
    if kv.modelopt_config is not None and kv.modelopt_num_bits is None:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg = update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, kv.modelopt_config)["quant_cfg"])
    cfg["quant_cfg"].append({"quantizer_name": "lm_head.*", "enable": False})
    enc = [tok(t, truncation=True, max_length=c.max_seq_len, return_tensors="pt") for t in texts]

    def loop(m: Any) -> None:
        with torch.no_grad():
            for i in range(0, len(enc), c.batch_size):
                group = enc[i:i + c.batch_size]
                longest = max(e["input_ids"].shape[1] for e in group)
                ids = torch.full((len(group), longest), tok.pad_token_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, e in enumerate(group):
                    ids[j, :e["input_ids"].shape[1]] = e["input_ids"][0]
                    mask[j, :e["input_ids"].shape[1]] = 1
                m(input_ids=ids, attention_mask=mask, use_cache=False)

    with contextlib.redirect_stdout(io.StringIO()):
        model = mtq.quantize(model, cfg, forward_loop=loop)
    mto.save(model, str(out / "checkpoint" / "modelopt_state.pth"))
    if r.target == "tensorrt":
        with contextlib.redirect_stdout(io.StringIO()):
            export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=getattr(torch, r.model.dtype),
                                           export_dir=str(out / "trtllm_checkpoint"), inference_tensor_parallel=1,
                                           inference_pipeline_parallel=1)
        tok.save_pretrained(str(out / "trtllm_checkpoint" / "tokenizer"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="int4_awq")
    parser.add_argument("--kv-cache", default="none")
    parser.add_argument("--target", default="tensorrt")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for both sides (1: steady timings on a shared machine; "
                             "0: torch's default)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from kiln.models.tiny import ensure_tiny_llama
    from kiln.recipe.loader import load_recipe

    model_dir = ensure_tiny_llama()
    loaded = load_recipe(REPO / "configs" / "tiny-llama.yaml",
                         [f"target={args.target}", f"quantization.format={args.format}",
                          f"quantization.kv_cache={args.kv_cache}"])
    r = loaded.recipe
    print(f"model {model_dir.name}, {r.quantization.format} (kv {r.quantization.kv_cache}), target {r.target}, "
          f"{r.quantization.calibration.samples} samples × {r.quantization.calibration.max_seq_len} tokens, "
          f"batch {r.quantization.calibration.batch_size}, dtype {r.model.dtype}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        kiln_run(loaded, root / "warm-kiln")  # imports, first-call costs
        bare_run(loaded, model_dir, root / "warm-bare")
        kiln_t, bare_t = [], []
        for i in range(args.runs):
            kiln_t.append(timed(kiln_run, loaded, root / f"kiln-{i}"))
            bare_t.append(timed(bare_run, loaded, model_dir, root / f"bare-{i}"))
            print(f"  run {i + 1}: kiln {kiln_t[-1][0]:.2f} s wall / {kiln_t[-1][1]:.2f} s CPU, "
                  f"bare {bare_t[-1][0]:.2f} s wall / {bare_t[-1][1]:.2f} s CPU")
    for what, i in (("wall", 0), ("CPU", 1)):
        k, b = statistics.median(t[i] for t in kiln_t), statistics.median(t[i] for t in bare_t)
        print(f"median of {args.runs} ({what}): kiln {k:.2f} s, bare ModelOpt {b:.2f} s, ratio {k / b:.3f}× "
              "(target ≤ 1.10×)")


if __name__ == "__main__":
    main()
