"""TensorRT-LLM's ``quantize_and_export`` alone, with a kiln quantize job's arguments (tests only).

    python quantize_only.py --job JOB.json

What upstream's ``examples/quantization/quantize.py`` does with those arguments: one call, no kiln wrapper around
``mtq.quantize`` (no saved quantizer state, no probe forward). The image-environment matrix runs it where kiln's worker
stops before the export on a CPU (tests/test_image_env.py, NVFP4), to show how far upstream's own path gets. With the
stand-in image's site on the path it calls the STAND-IN of 1.2.1's quantize_and_export.
"""

import json
import sys

from tensorrt_llm.quantization import quantize_and_export

KEYS = ("model_dir", "calib_dir", "dtype", "qformat", "kv_cache_dtype", "calib_size", "batch_size",
        "calib_max_seq_length", "awq_block_size", "output_dir", "tp_size", "pp_size", "seed",
        "tokenizer_max_seq_length")


def main(argv):
    if len(argv) != 2 or argv[0] != "--job":
        raise SystemExit(__doc__)
    with open(argv[1], encoding="utf-8") as fh:
        job = json.load(fh)
    args = {("calib_dataset" if k == "calib_dir" else k): job[k] for k in KEYS}
    quantize_and_export(device="cuda", cp_size=1, **args)


if __name__ == "__main__":
    main(sys.argv[1:])
