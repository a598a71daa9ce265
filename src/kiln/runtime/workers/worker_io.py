"""What kiln's engine-runtime workers share: the job file kiln wrote, the model on the runtime's device, and the
result file kiln reads back. It imports the standard library (torch and transformers inside the functions that
need them), never kiln; the workers import it as a sibling (``from worker_io import …``).
"""

import argparse
import json


def read_job(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def job_from_command_line(doc):
    """``python3 <worker>.py --job JOB.json``: the job, read (the worker's docstring's first line is its help)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--job", required=True, help="the job file (JSON) kiln wrote")
    return read_job(parser.parse_args().job)


def runtime_device():
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device):
    """What the result records as the device: the GPU's name, or ``cpu``."""
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def _max_memory(placement, torch):
    """The job's per-GPU budget for accelerate (GPU indices as ints), for the GPUs this process sees."""
    seen = torch.cuda.device_count()
    return {int(k): int(v) for k, v in (placement.get("max_memory") or {}).items() if int(k) < seen}


def load_model(job, device):
    """The job's model in the job's dtype (the checkpoint's own where the job names none kiln knows).

    On a GPU it is spread over the GPUs with ``device_map="auto"`` and, when the job carries kiln's placement, each
    GPU's ``max_memory`` budget from kiln's planner: a model larger than one GPU loads across the recipe's GPUs
    instead of failing on the first. A model that would need the CPU or the disk is refused with the figures."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(job["dtype"])
    if device != "cuda":
        model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype or "auto")
        return model.to(device).eval()
    placement = job.get("placement") or {}
    budget = _max_memory(placement, torch)
    kwargs = {"device_map": "auto", **({"max_memory": budget} if budget else {})}
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype or "auto", **kwargs)
    spilled = sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()} & {"cpu", "disk"})
    if spilled:
        raise SystemExit(f"the model does not fit the GPUs' budget (max_memory {budget}, kiln's plan: "
                         f"{placement.get('model_bytes')} bytes over {placement.get('gpus')} GPU(s)): accelerate "
                         f"placed layers on {', '.join(spilled)}. Give the workers more GPUs (hardware.count, "
                         "engine_runtime.gpus)")
    return model.eval()


def input_device(model):
    """Where a model's inputs go: its input embeddings' device (the first GPU of a model spread over several)."""
    return model.get_input_embeddings().weight.device


def free_memory():
    """Return freed tensors' memory to the device (call after dropping the last reference to a model)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ quantizer state, no weight copy

_CHUNK = 1 << 22


def weight_fingerprints(model):
    """A fingerprint of every parameter's exact bits (two int64 sums over its integer view, on its own device,
    in chunks): taken before calibration, it tells which weights calibration changed (SmoothQuant and AWQ fold
    scales into weights; FP8 and weight-only calibration change none)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            flat = p.detach().reshape(-1).view(ints[p.element_size()])
            plain, weighted = 0, 0
            for start in range(0, flat.numel(), _CHUNK):
                part = flat[start:start + _CHUNK].to(torch.int64)
                pos = torch.arange(start + 1, start + 1 + part.numel(), device=part.device, dtype=torch.int64)
                plain += int(part.sum())
                weighted += int((part * pos).sum())
            out[name] = (str(p.dtype), tuple(p.shape), plain, weighted)
    return out


def save_quantizer_state(model, path, before):
    """ModelOpt's state (``mto.modelopt_state``) plus the tensors the unquantized checkpoint does not already hold:
    the quantizers' own (amax, pre_quant_scale…) and any weight calibration changed (``before``: the
    :func:`weight_fingerprints` taken before calibration). Not ``mto.save``, which in ModelOpt 0.37 and 0.47 alike
    writes the whole ``model.state_dict()`` — a second full copy of the weights. Same keys as ``mto.save``'s file,
    plus the names left out; :func:`restore_quantizer_state` reads it back."""
    import modelopt.torch.opt as mto
    import torch

    after = weight_fingerprints(model)
    unchanged = sorted(n for n, f in after.items() if before.get(n) == f)
    skip = set(unchanged)
    tensors = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in skip}
    torch.save({"modelopt_state": mto.modelopt_state(model), "model_state_dict": tensors,
                "kiln_unchanged_weights": unchanged}, path)
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "unchanged_weights": len(unchanged)}


def restore_quantizer_state(model, path):
    """The quantized model from the unquantized ``model`` (loaded from the checkpoint) and the file
    :func:`save_quantizer_state` wrote (or a full ``mto.save`` file): ModelOpt's modes, then the saved tensors; every
    key the file leaves out must be a weight it names as unchanged."""
    import modelopt.torch.opt as mto
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    model = mto.restore_from_modelopt_state(model, state["modelopt_state"])
    result = model.load_state_dict(state["model_state_dict"], strict=False)
    allowed = set(state.get("kiln_unchanged_weights", ()))
    missing = [k for k in result.missing_keys if k not in allowed]
    if missing or result.unexpected_keys:
        raise SystemExit(f"{path} does not match the model: missing {missing[:5]}, unexpected "
                         f"{list(result.unexpected_keys)[:5]}")
    return model.eval()


def write_result(job, result):
    """The result file kiln reads, and the same JSON as the last line of output."""
    with open(job["result"], "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result), flush=True)
