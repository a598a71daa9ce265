"""Peak memory of kiln's quantize step on a ~1B-parameter Llama in bf16 on the CPU.

Target: peak RSS ≤ 1.3 × weight bytes + 1 GiB (the model loaded once, in the recipe dtype, plus the
libraries), i.e. no float32 detour and no second copy of the weights.

A randomly initialised Llama shaped like Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads, vocabulary
128256) is written once to a temporary directory in bf16 with the built-in model's tokenizer; then a
fresh Python process runs the quantize step on it (a few calibration samples) and reports its peak RSS
(``VmHWM`` from /proc: ``getrusage``'s ru_maxrss keeps the parent's peak across exec), so nothing from
making the model is counted.

    python benchmarks/quantize_memory.py [--format int8_wo] [--target reference] [--samples 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

GIB = 1 << 30

CHILD = textwrap.dedent("""
    import json, sys, time, warnings
    warnings.filterwarnings("ignore")
    from pathlib import Path
    from kiln.recipe.loader import LoadedRecipe, recipe_from_dict
    from kiln.steps.base import StepContext
    from kiln.steps.quantize import quantize
    model_dir, out, fmt, target, samples = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    def status(field):  # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, kept across exec)
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    import torch, modelopt.torch.quantization, transformers  # noqa: F401 - count the libraries in the baseline
    base = status("VmRSS")
    recipe = recipe_from_dict({"name": "mem", "target": target,
        "model": {"source": model_dir, "dtype": "bfloat16"},
        "quantization": {"format": fmt, "calibration": {"dataset": "builtin:tiny-llama-calib",
                         "samples": samples, "max_seq_len": 128, "batch_size": 1}},
        "evaluation": {"enabled": False}})
    out.mkdir()
    t0 = time.perf_counter()
    result = quantize(StepContext(LoadedRecipe(recipe, None), out, show_progress=False))
    peak = status("VmHWM")
    print(json.dumps({"peak": peak, "baseline": base, "seconds": time.perf_counter() - t0, "result": result}))
""")


def make_model(path: Path) -> int:
    """A random Llama-3.2-1B-shaped model in bf16 with the tiny tokenizer; returns the weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.tiny import ensure_tiny_llama

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(config)
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(path))
    tiny = ensure_tiny_llama()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, path / name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="int8_wo")
    parser.add_argument("--target", default="reference")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="reuse/keep the generated model in this directory")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.keep or Path(tmp) / "model"
        if not (model_dir / "config.json").is_file():
            t0 = time.perf_counter()
            make_model(model_dir)
            print(f"made the random model in {time.perf_counter() - t0:.0f} s")
        weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(Path(tmp) / "out"), args.format,
                               args.target, str(args.samples)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"quantize failed:\n{proc.stderr[-4000:]}")
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
    params = figures["result"]["params"]
    peak, base = figures["peak"], figures["baseline"]
    budget = 1.3 * weight_bytes + GIB
    print(f"{params / 1e9:.2f}B parameters, bf16 weights {weight_bytes / GIB:.2f} GiB; {args.format}, target "
          f"{args.target}, {args.samples} samples × 128 tokens, {figures['seconds']:.0f} s")
    print(f"peak RSS {peak / GIB:.2f} GiB (libraries alone {base / GIB:.2f} GiB); budget 1.3 × weights + 1 GiB = "
          f"{budget / GIB:.2f} GiB → {'within' if peak <= budget else 'OVER'} budget "
          f"({peak / weight_bytes:.2f} × weights)")


if __name__ == "__main__":
    main()
