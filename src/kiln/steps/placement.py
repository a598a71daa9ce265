"""Where a draft+target pair runs on the GPUs, and how they share the KV-cache memory.

TensorRT-LLM's ``kv_cache_free_gpu_mem_fraction`` is a fraction of the memory free *when the model loads*: with
both models at 0.9 on one GPU, the first to load takes the memory and the second gets almost none. So kiln
either gives each model its own GPUs (``gpu_device_ids``), when the machine has enough, or, on shared GPUs,
caps both with ``max_tokens_in_paged_kv_cache`` so that the two caches together fit the budget the planner
computes: every request lives in both caches, so both get the same token capacity ``T`` with
``T × (target bytes/token + draft bytes/token) ≤ fraction × (GPU memory − both models' weights and
workspace)``.

A pair where either model has tp × pp > 1 runs in TensorRT-LLM's orchestrator mode (upstream's
``--multi-model``; the draft-target README says it is necessary with tensor parallelism): one Triton process
spawns each model's ranks on its own GPUs. Orchestrator mode spawns processes on one node only, so a pair is
never spread over several nodes (the recipe rules refuse it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kiln.recipe.gpus import detect_gpus
from kiln.recipe.loader import LoadedRecipe
from kiln.util.errors import InputError


@dataclass(frozen=True)
class Placement:
    target_devices: str
    draft_devices: str
    kv_tokens: Optional[int]
    """The KV-cache token cap of both models on shared GPUs (None: each has its own GPUs)."""
    orchestrator: bool
    note: str


def _ids(start: int, count: int) -> str:
    return ",".join(str(i) for i in range(start, start + count))


def place_draft_target(target: LoadedRecipe, draft: LoadedRecipe) -> Placement:
    t, d = target.recipe, draft.recipe
    ws_t, ws_d = t.parallelism.tp * t.parallelism.pp, d.parallelism.tp * d.parallelism.pp
    detected = detect_gpus()
    available = t.hardware.count or (detected[1] if detected else None) or ws_t
    orchestrator = ws_t > 1 or ws_d > 1
    if available >= ws_t + ws_d:
        return Placement(_ids(0, ws_t), _ids(ws_t, ws_d), None, orchestrator,
                         f"target on GPU(s) {_ids(0, ws_t)}, draft on GPU(s) {_ids(ws_t, ws_d)}")
    if not t.hardware.gpu:
        raise InputError("hardware.gpu: the draft and target models share GPUs here, and kiln splits the KV-cache "
                         "memory between them with the planner, which needs the GPU model: set hardware.gpu (or "
                         f"hardware.count ≥ {ws_t + ws_d} to give the draft its own GPUs)")
    from kiln.plan import PlanError, plan_for

    try:
        pt = plan_for(target, t.hardware.gpu)
        pd = plan_for(draft, t.hardware.gpu)
    except PlanError as exc:
        raise InputError(f"cannot split the KV cache between the draft and target models: {exc}") from None
    used = (pt.weights.per_gpu_bytes + pt.workspace.total_bytes + pd.weights.per_gpu_bytes
            + pd.workspace.total_bytes)
    free = pt.kv_cache.gpu_memory_bytes - used
    budget = t.serving.kv_cache_free_gpu_mem_fraction * max(0, free)
    per_token = pt.kv_cache.bytes_per_token_per_gpu + pd.kv_cache.bytes_per_token_per_gpu
    block = t.engine.tokens_per_block
    tokens = int(budget // per_token) // block * block
    caps = [c for c in (t.serving.max_tokens_in_paged_kv_cache, d.serving.max_tokens_in_paged_kv_cache) if c]
    if caps:
        tokens = min([tokens, *caps])
    longest = t.engine.max_seq_len or t.engine.max_input_len
    if tokens < longest:
        raise InputError(f"the draft and target models do not fit together on one {pt.kv_cache.gpu_memory_bytes / 2**30:.0f}"
                         f" GiB {t.hardware.gpu}: {tokens} KV-cache tokens each, fewer than one {longest}-token "
                         f"sequence; give the draft its own GPU (hardware.count ≥ {ws_t + ws_d}) or a smaller draft")
    return Placement(_ids(0, ws_t), _ids(0, ws_d), tokens, orchestrator,
                     f"draft and target share GPU(s) {_ids(0, max(ws_t, ws_d))}: {tokens:,} KV-cache tokens each "
                     f"(of {budget / 2**30:.1f} GiB left after both models' weights)")
