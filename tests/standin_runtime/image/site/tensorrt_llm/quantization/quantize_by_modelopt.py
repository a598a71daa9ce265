"""STAND-IN for tensorrt_llm.quantization.quantize_by_modelopt of TensorRT-LLM 1.2.1 (tests only).

Read from upstream's rendered 1.2.1 module source (docs: ``_modules/tensorrt_llm/quantization/
quantize_by_modelopt.html``; the same code is in NVIDIA/TensorRT-LLM ``tensorrt_llm/quantization/
quantize_by_modelopt.py``, see src/kiln/runtime/data/upstream_api.yaml). Kept from upstream:

* ``quantize_and_export``'s exact keyword-only signature (tests/test_runtime_workers.py checks it against kiln's API
  data file);
* ``KV_CACHE_CFG`` in 1.2.1's shape: a FLAT dict of quantizer patterns (``"*.k_proj.output_quantizer": {...}``), which
  upstream merges with ``quant_cfg["quant_cfg"].update(KV_CACHE_CFG)`` for ``kv_cache_dtype="int8"``; FP8 KV merges
  ``mtq.FP8_KV_CFG["quant_cfg"]`` the same way; ``EMPTY_CFG`` for ``int8_wo``/``int4_wo``/``full_prec`` with a KV cache;
* the data loading: ``datasets.load_dataset(calib_dataset, split="train")["text"][:calib_size]`` of a local directory,
  ``batch_encode_plus(padding=True, truncation=True, max_length=calib_max_seq_length)``, ``input_ids`` only, batches of
  ``batch_size``, a zero-argument calibration loop calling ``model(**batch)``; the tokenizer loaded with
  ``padding_side="left"`` and ``model_max_length=tokenizer_max_seq_length``, pad = eos;
* AWQ: calibration capped at 32 samples, ``block_sizes[-1] = awq_block_size`` on the ``*weight_quantizer`` entry;
* the model loaded with ``device_map``, ``dtype="auto"``; accelerate's hooks removed before
  ``export_tensorrt_llm_checkpoint(model, model_type, dtype, export_dir=, inference_tensor_parallel=,
  inference_pipeline_parallel=)`` under ``torch.inference_mode()``; then config.json's edits (model_type,
  architecture, weight-only ``quant_algo``, ``rotary_scaling``, no KV algo for fp8/nvfp4 without a KV cache);
* ``mtq.quantize`` is looked up on the module at call time (kiln's quantize worker wraps it).

Where it must differ (no tensorrt_llm, no CUDA here):

* upstream raises without CUDA; the stand-in runs on the CPU but refuses any ``device`` other than ``"cuda"``
  (what upstream is always called with); ``device_map`` places the model on the CPU;
* ``infer_dtype`` and the model-type table are reduced to what kiln's Llama models need (``"llama"``);
* each call deep-copies the preset it starts from (upstream mutates ModelOpt's module-level preset, harmless in its
  one-call-per-process use; the image-environment matrix test calls it several times in one process);
* with a ModelOpt whose configs are lists of entries (>= 0.39: kiln's own environment, where the older stand-in
  tests run) the same entries are added in that shape; TensorRT-LLM 1.2.1 never meets that ModelOpt. With
  transformers >= 5 (no ``batch_encode_plus``) the tokenizer is called directly.

It proves the worker's calls and data flow against 1.2.1's interface, not TensorRT-LLM's numerics.
"""

import copy
import json
import os
import random

EMPTY_CFG = {
    "quant_cfg": {
        "*weight_quantizer": {"enable": False},
        "*input_quantizer": {"enable": False},
        "*lm_head*": {"enable": False},
        "*output_layer*": {"enable": False},
        "default": {"enable": False},
    },
    "algorithm": "max",
}

# 1.2.1's shape: a flat dict of quantizer patterns (no "quant_cfg" key).
KV_CACHE_CFG = {
    pattern: {"num_bits": 8, "axis": None, "enable": True}
    for pattern in ("*.query_key_value.output_quantizer", "*.Wqkv.output_quantizer", "*.W_pack.output_quantizer",
                    "*.c_attn.output_quantizer", "*.k_proj.output_quantizer", "*.v_proj.output_quantizer",
                    "*.k.output_quantizer", "*.v.output_quantizer")
}

KV_QUANT_CFG_CHOICES = {"fp8": "FP8_KV_CFG", "nvfp4": "NVFP4_KV_CFG"}


def quant_cfg_choices():
    import modelopt.torch.quantization as mtq

    empty = EMPTY_CFG
    if isinstance(mtq.INT8_SMOOTHQUANT_CFG["quant_cfg"], list):  # ModelOpt >= 0.39 (stand-in only, see above)
        empty = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    choices = {"int8_sq": mtq.INT8_SMOOTHQUANT_CFG, "fp8": mtq.FP8_DEFAULT_CFG,
               "fp8_pc_pt": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG, "int4_awq": mtq.INT4_AWQ_CFG,
               "w4a8_awq": mtq.W4A8_AWQ_BETA_CFG, "int8_wo": empty, "int4_wo": empty, "full_prec": empty}
    if hasattr(mtq, "NVFP4_DEFAULT_CFG"):
        choices["nvfp4"] = mtq.NVFP4_DEFAULT_CFG
    return choices


def _as_entries(patterns):
    """A flat {pattern: attrs} dict as the list entries of ModelOpt >= 0.39 (stand-in only, see the docstring)."""
    entries = []
    for name, attrs in patterns.items():
        if name == "default":
            continue
        attrs = dict(attrs)
        enable = attrs.pop("enable", True)
        entries.append({"quantizer_name": name, **({"cfg": attrs} if attrs else {}), "enable": enable})
    return entries


def _update(quant_cfg, patterns):
    """Upstream's ``quant_cfg["quant_cfg"].update(patterns)``, in the config's own shape."""
    if isinstance(quant_cfg["quant_cfg"], dict):
        quant_cfg["quant_cfg"].update(patterns)
    else:
        quant_cfg["quant_cfg"].extend(_as_entries(patterns) if isinstance(patterns, dict) else patterns)


def _weight_quantizer(quant_cfg):
    entries = quant_cfg["quant_cfg"]
    if isinstance(entries, dict):
        found = entries["*weight_quantizer"]
    else:
        found = next(e["cfg"] for e in entries if e.get("quantizer_name") == "*weight_quantizer")
    return found[0] if isinstance(found, list) else found


def quantize_and_export(*, model_dir, device, calib_dataset, dtype, qformat, kv_cache_dtype, calib_size, batch_size,
                        calib_max_seq_length, awq_block_size, output_dir, tp_size, pp_size, cp_size, seed,
                        tokenizer_max_seq_length, num_medusa_heads=None, num_medusa_layers=None, max_draft_len=None,
                        medusa_hidden_act=None, medusa_model_dir=None, quant_medusa_head=None,
                        auto_quantize_bits=None, device_map="auto", quantize_lm_head=False):
    if device != "cuda":
        raise ValueError(f"stand-in: upstream takes device='cuda' (got {device!r})")
    import modelopt.torch.quantization as mtq
    import numpy as np
    import torch
    from accelerate.hooks import remove_hook_from_module
    from datasets import load_dataset
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    random.seed(seed)
    np.random.seed(seed)
    if dtype == "auto":  # upstream's infer_dtype, for the dtypes kiln's models have
        stored = str(getattr(AutoConfig.from_pretrained(model_dir), "torch_dtype", None) or "float16")
        dtype = stored.replace("torch.", "")
        dtype = "float16" if dtype == "float32" else dtype
    model = AutoModelForCausalLM.from_pretrained(model_dir, device_map=device_map, dtype="auto",
                                                 trust_remote_code=True).eval()
    model_type = "llama"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, model_max_length=tokenizer_max_seq_length,
                                              padding_side="left", trust_remote_code=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    if not (qformat in ("full_prec", "int8_wo", "int4_wo") and kv_cache_dtype is None):
        if "awq" in qformat:
            calib_size = min(calib_size, 32)
        choices = quant_cfg_choices()
        if qformat not in choices:
            raise ValueError(f"Unsupported quantization format: {qformat}")
        quant_cfg = copy.deepcopy(choices[qformat])
        if "awq" in qformat and awq_block_size:
            _weight_quantizer(quant_cfg)["block_sizes"][-1] = awq_block_size
        if kv_cache_dtype is not None:
            if kv_cache_dtype == "fp8":
                _update(quant_cfg, getattr(mtq, KV_QUANT_CFG_CHOICES[kv_cache_dtype])["quant_cfg"])
            else:
                _update(quant_cfg, KV_CACHE_CFG)
        if qformat == "fp8" and quantize_lm_head:
            del quant_cfg["quant_cfg"]["*lm_head*"]

        texts = load_dataset(calib_dataset, split="train", trust_remote_code=True)["text"][:calib_size]
        encode = getattr(tokenizer, "batch_encode_plus", tokenizer)
        encoded = encode(texts, return_tensors="pt", padding=True, truncation=True, max_length=calib_max_seq_length)
        loader = DataLoader(encoded["input_ids"].to(model.device), batch_size=batch_size, shuffle=False)

        def calibrate_loop():
            with torch.no_grad():
                for data in loader:
                    model(input_ids=data)

        model = mtq.quantize(model, quant_cfg, forward_loop=calibrate_loop)

    with torch.inference_mode():
        architecture = type(model).__name__
        remove_hook_from_module(model, recurse=True)
        export_tensorrt_llm_checkpoint(model, model_type, getattr(torch, dtype), export_dir=output_dir,
                                       inference_tensor_parallel=tp_size, inference_pipeline_parallel=pp_size)
        path = os.path.join(output_dir, "config.json")
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
        config["model_type"] = model_type
        config["architecture"] = architecture
        if qformat in ("int8_wo", "int4_wo", "full_prec"):
            config["quantization"]["quant_algo"] = {"int8_wo": "W8A16", "int4_wo": "W4A16"}.get(qformat)
        if hasattr(model.config, "rope_scaling") and "rotary_scaling" not in config:
            config["rotary_scaling"] = getattr(model.config, "rope_scaling")
        if qformat in ("fp8", "nvfp4") and kv_cache_dtype is None:
            config["quantization"]["kv_cache_quant_algo"] = None
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=4)
