"""kiln's unified-checkpoint worker, run inside the engine runtime for target pytorch: the image's ModelOpt (the one
its TensorRT-LLM was made with) calibrates on the GPU and writes ModelOpt's unified Hugging Face checkpoint, what
TensorRT-LLM's PyTorch backend loads.

    python3 export_hf.py --job JOB.json

TensorRT-LLM 1.2.1's quantize_and_export writes only the TensorRT-LLM checkpoint, so this worker calls ModelOpt
directly, the way ModelOpt's own examples/llm_ptq does for its unified export:

* the format's ModelOpt preset (named by kiln's format registry, read from the image's ModelOpt) with the recipe's
  AWQ block size, KV-cache quantizers and excluded modules, calibrated with ``mtq.quantize`` on kiln's hashed
  calibration texts;
* ModelOpt's export step ``requantize_resmooth_fused_llm_layers`` right after calibration, then the calibrated
  quantizers and a probe's logits are saved (so the evaluate worker grades exactly what is exported);
* ``export_hf_checkpoint`` and the tokenizer beside it.

It imports only what the runtime has (torch, transformers, modelopt, safetensors) and the shared helpers of its
siblings (the quantize worker, worker_io), never kiln. The job file names every path as the runtime sees it.
"""

import copy
import time

from quantize import calibration_loop, calibration_texts, disable_patterns, merge_entries, save_state, versions
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


def kv_entries(mtq, job):
    """The KV-cache quantizer entries of the job's preset, with the job's bit width where it sets one."""
    entries = copy.deepcopy(getattr(mtq, job["kv_preset"])["quant_cfg"])
    bits = job.get("kv_num_bits")
    if bits is None:
        return entries

    def with_bits(attrs):
        return {**attrs, "num_bits": bits} if isinstance(attrs, dict) and "num_bits" in attrs else attrs

    if isinstance(entries, dict):
        return {k: with_bits(v) for k, v in entries.items() if k != "default"}
    return [{**e, "cfg": with_bits(e["cfg"])} if "cfg" in e else e for e in entries]


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


def main():
    job = job_from_command_line(__doc__)
    started = time.monotonic()

    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
    from transformers import AutoTokenizer

    device = runtime_device()
    torch.manual_seed(job["seed"])
    model = load_model(job, device)  # spread over the recipe's GPUs (worker_io.load_model)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    texts = calibration_texts(job)[: job["calib_size"]]
    before = weight_fingerprints(model)
    model = mtq.quantize(model, quant_config(mtq, job),
                         forward_loop=calibration_loop(job, tokenizer, texts, input_device(model)))
    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)  # what export_hf_checkpoint does first; see the docstring
    held = save_state(model, job, before)
    export_hf_checkpoint(model, dtype=getattr(torch, job["dtype"]), export_dir=job["output_dir"])
    tokenizer.save_pretrained(job["output_dir"])
    write_result(job, {"packages": versions(), "device": device_name(device), "state_from": "calibration", "state": held,
                       "export": "modelopt.torch.export.export_hf_checkpoint",
                       "seconds": round(time.monotonic() - started, 3)})


if __name__ == "__main__":
    main()
