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


def load_model(job, device):
    """The job's model in the job's dtype (the checkpoint's own where the job names none kiln knows)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(job["dtype"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=dtype or "auto")
    return model.to(device).eval()


def write_result(job, result):
    """The result file kiln reads, and the same JSON as the last line of output."""
    with open(job["result"], "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result), flush=True)
