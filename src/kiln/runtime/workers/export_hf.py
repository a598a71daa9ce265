"""kiln's unified-checkpoint worker, run inside the engine runtime for target pytorch: the image's ModelOpt (the one
its TensorRT-LLM was made with) calibrates on the GPU and writes ModelOpt's unified Hugging Face checkpoint, what
TensorRT-LLM's PyTorch backend loads.

    python3 export_hf.py --job JOB.json

TensorRT-LLM 1.2.1's quantize_and_export writes only the TensorRT-LLM checkpoint, so this worker calls ModelOpt
directly, the way ModelOpt's own examples/llm_ptq does for its unified export:

* the format's ModelOpt preset (named by kiln's format registry, read from the image's ModelOpt) with the recipe's
  AWQ block size, KV-cache quantizers and excluded modules, calibrated with ``mtq.quantize`` on kiln's hashed
  calibration texts;
* ``export_hf_checkpoint`` and the tokenizer beside it. The exporter first resmooths the fused layers
  (``requantize_resmooth_fused_llm_layers``: AWQ's shared pre-quant scales folded into the layernorms), the last
  change to the fake-quantized model before its weights are packed; the calibrated quantizers and a probe's logits
  are saved right after that step, so the evaluate worker grades exactly what is exported. The step runs once:
  ModelOpt 0.37 (TensorRT-LLM 1.2.1's) has no guard against a second pass, which fails (``'TensorQuantizer' object
  has no attribute '_pre_quant_scale'``). Only where the image's exporter does not resmooth itself does the worker
  call the step (see :func:`export`).

It imports only what the runtime has (torch, transformers, modelopt, safetensors) and the shared helpers of its
siblings (the quantize worker, worker_io), never kiln. The job file names every path as the runtime sees it.
"""

import copy
import time

from quantize import (calibration_loop, calibration_texts, disable_patterns, kv_entries, merge_entries, save_state,
                      versions)
from worker_io import (
    device_name,
    input_device,
    job_from_command_line,
    load_model,
    runtime_device,
    weight_fingerprints,
    write_result,
)


def set_block_size(config, block):
    """The AWQ group size on the weight quantizer(s) with block sizes, in either config shape."""
    entries = config["quant_cfg"]
    items = entries.items() if isinstance(entries, dict) else ((e.get("quantizer_name"), e.get("cfg")) for e in entries)
    for name, attrs in list(items):
        if name != "*weight_quantizer":
            continue
        for one in attrs if isinstance(attrs, (list, tuple)) else [attrs]:
            sizes = one.get("block_sizes") if isinstance(one, dict) else None
            if isinstance(sizes, dict):
                key = "-1" if "-1" in sizes and -1 not in sizes else -1
                sizes[key] = block
    return config


def quant_config(mtq, job):
    """The ModelOpt config the recipe means, built from the image's own presets."""
    if job["preset"]:
        config = copy.deepcopy(getattr(mtq, job["preset"]))
        if job.get("awq_block_size") and job.get("uses_block_size"):
            config = set_block_size(config, job["awq_block_size"])
        if job.get("smoothquant_alpha") is not None:
            config["algorithm"] = {"method": "smoothquant", "alpha": job["smoothquant_alpha"]}
    elif isinstance(getattr(mtq, job["kv_preset"])["quant_cfg"], dict):  # KV only, in the presets' own shape
        config = {"quant_cfg": {"default": {"enable": False}}, "algorithm": "max"}
    else:
        config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    if job.get("kv_preset"):
        config = merge_entries(config, kv_entries(mtq, job))
    return disable_patterns(config, job.get("exclude_patterns", []))


def exporter_resmooths(unified):
    """Whether the image's ``export_hf_checkpoint`` resmooths the fused layers itself, read from its source: 0.37's
    ``_export_hf_checkpoint`` and 0.47's ``_export_transformers_checkpoint`` do."""
    import inspect

    for name in ("_export_hf_checkpoint", "_export_transformers_checkpoint"):
        try:
            if "requantize_resmooth_fused_llm_layers(" in inspect.getsource(getattr(unified, name)):
                return True
        except (AttributeError, OSError, TypeError):
            continue
    return False


def export(model, job, dtype, before):
    """ModelOpt's unified export with the quantizers saved right after the fused layers are resmoothed, the
    resmoothing done exactly once: by the image's exporter where it does it, else here. ``before``: the weights'
    fingerprints from before calibration (see save_state); returns what the state file holds."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export import unified_export_hf as unified

    if not exporter_resmooths(unified):
        with torch.no_grad():
            unified.requantize_resmooth_fused_llm_layers(model)
        held = save_state(model, job, before)
        export_hf_checkpoint(model, dtype=dtype, export_dir=job["output_dir"])
        return held
    resmooth = unified.requantize_resmooth_fused_llm_layers
    saved = []

    def resmooth_then_save(m):
        resmooth(m)
        saved.append(save_state(m, job, before))  # still the fake-quantized model: the exporter packs weights next

    unified.requantize_resmooth_fused_llm_layers = resmooth_then_save
    try:
        export_hf_checkpoint(model, dtype=dtype, export_dir=job["output_dir"])
    finally:
        unified.requantize_resmooth_fused_llm_layers = resmooth
    if not saved:
        raise SystemExit("the image's export_hf_checkpoint did not resmooth the fused layers as its source says: the "
                         "calibrated quantizers were not saved; kiln supports nvidia-modelopt 0.37 to 0.47")
    return saved[0]


def main():
    job = job_from_command_line(__doc__)
    started = time.monotonic()

    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoTokenizer

    device = runtime_device()
    torch.manual_seed(job["seed"])
    model = load_model(job, device)  # spread over the recipe's GPUs (worker_io.load_model)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    texts = calibration_texts(job)[: job["calib_size"]]
    before = weight_fingerprints(model)
    model = mtq.quantize(model, quant_config(mtq, job),
                         forward_loop=calibration_loop(job, tokenizer, texts, input_device(model)))
    held = export(model, job, getattr(torch, job["dtype"]), before)
    tokenizer.save_pretrained(job["output_dir"])
    write_result(job, {"packages": versions(), "device": device_name(device), "state_from": "calibration", "state": held,
                       "export": "modelopt.torch.export.export_hf_checkpoint",
                       "seconds": round(time.monotonic() - started, 3)})


if __name__ == "__main__":
    main()
