"""STAND-IN for tensorrt_llm.quantization.quantize_by_modelopt of TensorRT-LLM 1.2.1 (tests only).

``quantize_and_export`` has upstream's exact keyword-only signature (tests/test_runtime_workers.py checks it
against kiln's API data file, src/kiln/runtime/data/upstream_api.yaml) and takes upstream's steps — choose the
format's ModelOpt config, calibrate on the `text` column of the `train` split of ``calib_dataset`` through
``modelopt.torch.quantization.quantize`` (looked up on the module at call time, as upstream does), export the
TensorRT-LLM checkpoint, force quant_algo for weight-only formats — with the ModelOpt installed here, on the
CPU. It is a stand-in: it proves the worker's calls and data flow, not TensorRT-LLM's numerics.
"""

import copy
import json
import os
import random

# Upstream's quant_cfg_choices(): qformat -> ModelOpt preset (None: every quantizer off, nothing calibrated).
CHOICES = {"fp8": "FP8_DEFAULT_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG", "int4_awq": "INT4_AWQ_CFG",
           "w4a8_awq": "W4A8_AWQ_BETA_CFG", "nvfp4": "NVFP4_DEFAULT_CFG", "int8_wo": None, "int4_wo": None,
           "full_prec": None}
WEIGHT_ONLY_ALGO = {"int8_wo": "W8A16", "int4_wo": "W4A16", "full_prec": None}

# Upstream's KV_CACHE_CFG: 8-bit integer output quantizers on the K and V projections (the ModelOpt shape here).
KV_CACHE_CFG = {"quant_cfg": [{"quantizer_name": p, "cfg": {"num_bits": 8, "axis": None}, "enable": True}
                              for p in ("*k_proj.output_quantizer", "*v_proj.output_quantizer")]}


def quantize_and_export(*, model_dir, device, calib_dataset, dtype, qformat, kv_cache_dtype, calib_size, batch_size,
                        calib_max_seq_length, awq_block_size, output_dir, tp_size, pp_size, cp_size, seed,
                        tokenizer_max_seq_length, num_medusa_heads=None, num_medusa_layers=None, max_draft_len=None,
                        medusa_hidden_act=None, medusa_model_dir=None, quant_medusa_head=None,
                        auto_quantize_bits=None, device_map="auto", quantize_lm_head=False):
    if device != "cuda":
        raise ValueError(f"stand-in: upstream takes device='cuda' (got {device!r})")
    import datasets
    import modelopt.torch.quantization as mtq
    import numpy as np
    import torch
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from modelopt.torch.quantization.utils import update_quant_cfg_with_kv_cache_quant
    from transformers import AutoModelForCausalLM, AutoTokenizer

    random.seed(seed)
    np.random.seed(seed)
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left",
                                              model_max_length=tokenizer_max_seq_length)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not (qformat in WEIGHT_ONLY_ALGO and kv_cache_dtype is None):
        if "awq" in qformat:
            calib_size = min(calib_size, 32)
        preset = CHOICES[qformat]
        config = (copy.deepcopy(getattr(mtq, preset)) if preset
                  else {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"})
        if "awq" in qformat:
            for entry in config["quant_cfg"]:
                if entry.get("quantizer_name") == "*weight_quantizer":
                    cfgs = entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]
                    cfgs[0]["block_sizes"][-1] = awq_block_size
        if kv_cache_dtype == "fp8":
            config = update_quant_cfg_with_kv_cache_quant(config, getattr(mtq, "FP8_KV_CFG")["quant_cfg"])
        elif kv_cache_dtype is not None:
            config = update_quant_cfg_with_kv_cache_quant(config, KV_CACHE_CFG["quant_cfg"])
        texts = datasets.load_dataset(calib_dataset, split="train")["text"][:calib_size]
        batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=calib_max_seq_length)

        def calibrate_loop(m):
            with torch.no_grad():
                for start in range(0, len(texts), batch_size):
                    m(input_ids=batch["input_ids"][start:start + batch_size],
                      attention_mask=batch["attention_mask"][start:start + batch_size])

        model = mtq.quantize(model, config, forward_loop=calibrate_loop)
    with torch.inference_mode():
        export_tensorrt_llm_checkpoint(model, "llama", torch_dtype, export_dir=output_dir,
                                       inference_tensor_parallel=tp_size, inference_pipeline_parallel=pp_size)
    path = os.path.join(output_dir, "config.json")
    with open(path, encoding="utf-8") as fh:
        config_json = json.load(fh)
    quant = config_json.setdefault("quantization", {})
    if qformat in WEIGHT_ONLY_ALGO:
        quant["quant_algo"] = WEIGHT_ONLY_ALGO[qformat]
    if qformat in ("fp8", "nvfp4") and kv_cache_dtype is None:
        quant["kv_cache_quant_algo"] = None
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config_json, fh, indent=4)
