"""kiln's quantize worker, run inside the engine runtime: TensorRT-LLM's own ModelOpt integration on the GPU.

    python3 quantize.py --job JOB.json

It calls ``tensorrt_llm.quantization.quantize_and_export`` — the API behind TensorRT-LLM's
``examples/quantization/quantize.py`` — so the checkpoint ``trtllm-build`` reads is exported by the ModelOpt
TensorRT-LLM was made with. Around that call it adds what kiln's recipe and quality gate need:

* the recipe's excluded modules and SmoothQuant strength are applied to the ModelOpt config TensorRT-LLM chose;
* right after calibration, the calibrated quantizers are saved (ModelOpt's state plus the quantizers' tensors and
  any weight calibration changed, not a second copy of the weights: worker_io.save_quantizer_state) with the
  logits of a probe, so that the evaluate worker grades exactly the quantizers that were exported;
* for formats TensorRT-LLM quantizes at build time (weight-only), whose export calibrates nothing, the same
  per-channel scheme is applied to a copy of the model for the quality gate;
* the tokenizer is copied beside the checkpoint (quantize_and_export writes none).

It imports only what the runtime has (torch, transformers, modelopt, tensorrt_llm, safetensors) and its siblings
(worker_io, probe), never kiln.
The job file names every path as the runtime sees it; the result file records versions and timings.
"""

import copy
import json
import os
import time

from worker_io import (
    device_name,
    free_memory,
    input_device,
    job_from_command_line,
    load_model,
    runtime_device,
    save_quantizer_state,
    weight_fingerprints,
    write_result,
)


def disable_patterns(config, patterns):
    """Append "disable these quantizers" entries in the config's own shape (a dict in ModelOpt 0.37, a list of
    entries in later releases); later entries win in both."""
    entries = config.get("quant_cfg")
    if isinstance(entries, dict):
        for pattern in patterns:
            entries[pattern] = {"enable": False}
    elif isinstance(entries, list):
        entries.extend({"quantizer_name": pattern, "enable": False} for pattern in patterns)
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


def adjust(config, job):
    """The recipe's choices on top of the config TensorRT-LLM picked for the format.

    An INT8 KV cache also gets ModelOpt's own KV-cache quantizers (the registry's preset at 8 bits: the attention's
    ``k_bmm_quantizer``/``v_bmm_quantizer``). TensorRT-LLM 1.2.1's ``KV_CACHE_CFG`` enables only the K/V projections'
    output quantizers, and ModelOpt 0.37's TensorRT-LLM export reads the KV-cache dtype and scales from the bmm
    quantizers alone: without them the checkpoint says no KV-cache quantization (kv_cache_quant_algo null)."""
    config = copy.deepcopy(config)
    if job.get("kv_cache_dtype") == "int8" and job.get("kv_preset"):
        import modelopt.torch.quantization as mtq

        config = merge_entries(config, kv_entries(mtq, job))
    alpha = job.get("smoothquant_alpha")
    algorithm = config.get("algorithm")
    if alpha is not None and (algorithm == "smoothquant" or
                              (isinstance(algorithm, dict) and algorithm.get("method") == "smoothquant")):
        config["algorithm"] = {"method": "smoothquant", "alpha": alpha}
    return disable_patterns(config, job.get("exclude_patterns", []))


def per_channel_int4(config):
    """TensorRT-LLM's INT4 weight-only scales are per output channel: the fake-quant model uses the same."""
    entries = config["quant_cfg"]
    items = entries.items() if isinstance(entries, dict) else ((e.get("quantizer_name"), e.get("cfg")) for e in entries)
    for name, attrs in list(items):
        if name == "*weight_quantizer" and isinstance(attrs, dict):
            attrs.pop("block_sizes", None)
            attrs.update({"num_bits": 4, "axis": 0})
    return config


def merge_entries(config, entries):
    """Add KV-cache quantizer entries to a config, in the config's own shape (as quantize_and_export does).

    ``entries`` is a flat dict of quantizer patterns (ModelOpt 0.37's presets' shape, and TensorRT-LLM 1.2.1's
    ``KV_CACHE_CFG``) or a list of entries (ModelOpt >= 0.39); a flat dict is turned into entries for a list config."""
    config = copy.deepcopy(config)
    base = config.get("quant_cfg")
    if isinstance(entries, dict) and isinstance(entries.get("quant_cfg"), (dict, list)):
        raise SystemExit("merge_entries takes the quantizer patterns, not a whole config (its 'quant_cfg')")
    if isinstance(base, dict) and isinstance(entries, dict):
        base.update({k: v for k, v in entries.items() if k != "default"})
    elif isinstance(base, list) and isinstance(entries, list):
        base.extend(e for e in entries if e.get("quantizer_name") != "*")
    elif isinstance(base, list) and isinstance(entries, dict):
        for name, attrs in entries.items():
            if name == "default":
                continue
            attrs = dict(attrs)
            enable = attrs.pop("enable", True)
            base.append({"quantizer_name": name, **({"cfg": attrs} if attrs else {}), "enable": enable})
    else:
        raise SystemExit("the runtime's ModelOpt mixes config shapes; kiln supports nvidia-modelopt 0.37 to 0.47")
    return config


def save_state(model, job, before):
    """The calibrated quantizers (``before``: the weights' fingerprints from before calibration), and a probe's
    logits that the restored model must reproduce. Returns what the state file holds."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    os.makedirs(os.path.dirname(job["modelopt_state"]), exist_ok=True)
    held = save_quantizer_state(model, job["modelopt_state"], before)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    ids = torch.tensor(tokenizer(job["probe_text"])["input_ids"][: job.get("probe_tokens", 32)])[None, :]
    device = input_device(model)
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()}, job["restore_check"])
    return held


def calibration_texts(job):
    with open(os.path.join(job["calib_dir"], "train.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line)["text"] for line in fh if line.strip()]


def calibration_loop(job, tokenizer, texts, device):
    """ModelOpt's ``forward_loop``: the calibration texts through the model, each cut to the job's length."""
    import torch

    def forward_loop(m):
        with torch.no_grad():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt", truncation=True,
                                max_length=job["calib_max_seq_length"])["input_ids"]
                m(input_ids=ids.to(device), use_cache=False)

    return forward_loop


def fake_quant_state(job, quantize, device):
    """Weight-only formats: TensorRT-LLM's export calibrates nothing (it quantizes at build time). Apply the same
    per-channel weight scheme to the unquantized model, so the quality gate measures what the engine runs."""
    import modelopt.torch.quantization as mtq
    from transformers import AutoTokenizer

    fake = job["fake_quant"]
    config = copy.deepcopy(getattr(mtq, fake["preset"]))
    if fake.get("per_channel"):
        config = per_channel_int4(config)
    config = disable_patterns(config, fake.get("disable", []))
    if job["kv_cache_dtype"] == "fp8":
        config = merge_entries(config, getattr(mtq, job["kv_preset"])["quant_cfg"])
    elif job["kv_cache_dtype"]:
        from tensorrt_llm.quantization.quantize_by_modelopt import KV_CACHE_CFG

        config = merge_entries(config, KV_CACHE_CFG)  # what quantize_and_export uses for int8: 1.2.1's flat dict
    free_memory()  # quantize_and_export's model is gone: one model on the GPUs at a time
    model = load_model(job, device)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    texts = calibration_texts(job)[: max(1, min(job["calib_size"], 32))]
    quantize(model, config, forward_loop=calibration_loop(job, tokenizer, texts, input_device(model)))


def versions():
    """The runtime's package versions, as the probe reads them (probe.py sits beside this script)."""
    from probe import PACKAGES, version

    return {key: version(names) for key, names in PACKAGES.items()}


def main():
    job = job_from_command_line(__doc__)
    started = time.monotonic()

    import modelopt.torch.quantization as mtq
    from tensorrt_llm.quantization import quantize_and_export
    from transformers import AutoTokenizer

    device = runtime_device()
    real_quantize = mtq.quantize
    calibrated = []

    def quantize(model, config, forward_loop=None):
        before = weight_fingerprints(model)
        model = real_quantize(model, adjust(config, job), forward_loop=forward_loop)
        calibrated.append(save_state(model, job, before))
        return model

    mtq.quantize = quantize  # quantize_and_export calls mtq.quantize once it has chosen the format's config
    try:
        quantize_and_export(
            model_dir=job["model_dir"], device="cuda", calib_dataset=job["calib_dir"], dtype=job["dtype"],
            qformat=job["qformat"], kv_cache_dtype=job["kv_cache_dtype"], calib_size=job["calib_size"],
            batch_size=job["batch_size"], calib_max_seq_length=job["calib_max_seq_length"],
            awq_block_size=job["awq_block_size"], output_dir=job["output_dir"], tp_size=job["tp_size"],
            pp_size=job["pp_size"], cp_size=1, seed=job["seed"],
            tokenizer_max_seq_length=job["tokenizer_max_seq_length"])
        if job.get("fake_quant"):
            calibrated.clear()
            fake_quant_state(job, quantize, device)  # what the quality gate grades for build-time quantization
        elif not calibrated:
            raise SystemExit(f"quantize_and_export calibrated nothing for {job['qformat']}: no quantizers to grade")
    finally:
        mtq.quantize = real_quantize
    AutoTokenizer.from_pretrained(job["model_dir"]).save_pretrained(os.path.join(job["output_dir"], "tokenizer"))
    write_result(job, {"packages": versions(), "device": device_name(device),
                       "state_from": "weights" if job.get("fake_quant") else "calibration",
                       "state": calibrated[-1] if calibrated else None,
                       "seconds": round(time.monotonic() - started, 3)})


if __name__ == "__main__":
    main()
