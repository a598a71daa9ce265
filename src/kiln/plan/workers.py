"""Memory of the engine-runtime workers (quantize, export_hf, evaluate) on the recipe's GPUs, and the per-GPU budget
they load the model with (``device_map="auto"``, ``max_memory``).

The workers hold the *unquantized* model in the recipe's dtype (ModelOpt's fake-quant model keeps the original
weights plus small quantizer tensors), spread over the recipe's GPUs, one model at a time: the evaluate worker
scores the base model first, keeps its per-token log-probabilities on the scratch disk (fp16) and frees it before it
loads the quantized one. On top of the weights each GPU needs its CUDA context and workspaces, and the last one the
logits of a batch (float32, with their log-softmax and probabilities: 3 copies) — the evaluation's or the
calibration's, whichever is larger.

This is arithmetic from the model's config and the recipe, like the rest of the planner; it does not look at a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from kiln.plan.formats import base_dtype_bytes
from kiln.plan.planner import GIB, RUNTIME_OVERHEAD_BYTES, Plan

#: Of each GPU's memory, the share the workers may use (the rest: fragmentation, the allocator's cache).
WORKER_MEMORY_FRACTION = 0.9
#: Upper bound on logits elements per evaluation batch (batch × tokens × vocabulary), to bound memory.
EVAL_LOGITS_BUDGET = 1 << 26
#: Float32 copies of a batch's logits alive at once while scoring: logits, log-softmax, probabilities.
LOGITS_COPIES = 3
#: Bytes per stored base log-probability (fp16) on the scratch disk, per token and vocabulary entry.
STORED_LOGPROB_BYTES = 2

WORKER_BASIS = (
    "the unquantized model in the recipe's dtype (params × dtype bytes) spread over the GPUs; per GPU the CUDA "
    f"context and workspaces ({RUNTIME_OVERHEAD_BYTES / GIB:g} GiB) and, on the last GPU, a batch's float32 logits "
    f"× {LOGITS_COPIES} (evaluation: batch × max_seq_len × vocab; calibration: batch_size × max_seq_len × vocab); "
    f"the workers may use {WORKER_MEMORY_FRACTION:.0%} of each GPU. Evaluate holds one model at a time: the base "
    "model's per-token log-probabilities wait on the scratch disk in fp16 (samples × max_seq_len × vocab × 2 bytes)"
)


def eval_batch_size(max_seq_len: int, vocab: int) -> int:
    """Sequences per evaluation batch: as many as keep the batch's logits under :data:`EVAL_LOGITS_BUDGET` (1-16)."""
    return max(1, min(16, EVAL_LOGITS_BUDGET // max(1, max_seq_len * vocab)))


@dataclass
class WorkerMemory:
    """The workers' memory on ``gpus`` GPUs of ``gpu_memory_bytes`` each."""

    gpus: int
    gpu_memory_bytes: int
    dtype: str
    model_bytes: int                #: the unquantized model, all GPUs together
    logits_bytes: int               #: a batch's logits (all copies), on the last GPU
    overhead_bytes: int             #: per GPU
    budget_bytes_per_gpu: int       #: what ``max_memory`` gives the weights on each GPU
    need_bytes_per_gpu: int         #: weights ÷ GPUs + overhead (+ logits on the last)
    fits: bool
    eval_batch: int
    base_logprob_bytes: int         #: scratch disk for the base model's log-probabilities (evaluate)
    basis: str = WORKER_BASIS

    def max_memory(self) -> dict[str, int]:
        """``max_memory`` for ``from_pretrained(device_map="auto")``: GPU index (as a string, JSON keys) → bytes."""
        return {str(i): self.budget_bytes_per_gpu - (self.logits_bytes if i == self.gpus - 1 else 0)
                for i in range(self.gpus)}

    def placement(self) -> dict[str, Any]:
        """What a worker's job file carries: the GPUs to spread over and each one's budget."""
        return {"gpus": self.gpus, "max_memory": self.max_memory(), "model_bytes": self.model_bytes}

    def verdict(self) -> str:
        per = self.model_bytes / self.gpus
        head = (f"{self.model_bytes / GIB:,.1f} GiB unquantized ({self.dtype}) over {self.gpus} GPU(s): "
                f"{per / GIB:,.1f} GiB each + {self.overhead_bytes / GIB:g} GiB runtime + "
                f"{self.logits_bytes / GIB:,.2f} GiB logits on the last; budget "
                f"{self.budget_bytes_per_gpu / GIB:,.1f} GiB per GPU ({WORKER_MEMORY_FRACTION:.0%} of "
                f"{self.gpu_memory_bytes / GIB:g} GiB)")
        if self.fits:
            return "fits: " + head
        return ("does not fit: " + head + ". Give the workers more GPUs (hardware.count, engine_runtime.gpus) or "
                "fewer/shorter evaluation sequences")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def worker_memory(plan: Plan, *, eval_samples: int, eval_seq_len: int, calib_batch: int, calib_seq_len: int,
                  gpus: Optional[int] = None) -> WorkerMemory:
    """The workers' memory for ``plan``'s model on ``gpus`` GPUs (default: the plan's count, else tp × pp)."""
    count = gpus or plan.gpu_count or plan.world_size
    dtype = str(plan.weights.base_dtype)
    model_bytes = int(plan.weights.total_params) * base_dtype_bytes(dtype)
    vocab = int(plan.model["vocab_size"])
    batch = eval_batch_size(eval_seq_len, vocab)
    logits = 4 * vocab * max(batch * eval_seq_len * LOGITS_COPIES, calib_batch * calib_seq_len)
    gpu_bytes = int(plan.gpu["memory_gib"] * GIB)
    budget = int(gpu_bytes * WORKER_MEMORY_FRACTION) - RUNTIME_OVERHEAD_BYTES
    per_gpu_weights = -(-model_bytes // count)
    need = per_gpu_weights + RUNTIME_OVERHEAD_BYTES + logits
    # accelerate fills the GPUs in order up to each budget: the last GPU's budget is reduced by the logits
    fits = model_bytes <= count * budget - logits
    return WorkerMemory(gpus=count, gpu_memory_bytes=gpu_bytes, dtype=dtype, model_bytes=model_bytes,
                        logits_bytes=logits, overhead_bytes=RUNTIME_OVERHEAD_BYTES, budget_bytes_per_gpu=budget,
                        need_bytes_per_gpu=need, fits=fits, eval_batch=batch,
                        base_logprob_bytes=eval_samples * eval_seq_len * vocab * STORED_LOGPROB_BYTES)


def recipe_worker_memory(loaded, plan: Plan) -> WorkerMemory:
    """:func:`worker_memory` with the recipe's evaluation and calibration settings."""
    r = loaded.recipe
    ev, cal = r.evaluation, r.quantization.calibration
    return worker_memory(plan, eval_samples=ev.samples if ev.enabled else 0, eval_seq_len=ev.max_seq_len,
                         calib_batch=cal.batch_size, calib_seq_len=cal.max_seq_len)
