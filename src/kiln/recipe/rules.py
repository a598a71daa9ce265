"""Cross-field rules: what TensorRT-LLM and Triton only report late (after a GPU-hour) or silently.

Each rule reads a validated :class:`Recipe` and returns problems naming the dotted key to change.
Errors stop the recipe; warnings describe quiet upstream adjustments (``--strict`` turns them into errors).
"""

from __future__ import annotations

from typing import Callable, Iterator

from kiln.recipe.errors import Problem
from kiln.recipe.formats import format_refusal, kv_cache_format, kv_cache_format_names, kv_refusal, weight_format
from kiln.recipe.gpus import GPUSpec, known_gpu_names, lookup_gpu
from kiln.recipe.containers import JOB_CONTAINERS, LAST_ENGINE_VERSION, has_engine_path
from kiln.recipe.schema import Recipe, quantization_runtime
from kiln.util.dotted import dotted_attr

Rule = Callable[[Recipe], Iterator[Problem]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def err(key: str, message: str, hint: str = "") -> Problem:
    return Problem("error", key, message, None, hint)


def warn(key: str, message: str, hint: str = "") -> Problem:
    return Problem("warning", key, message, None, hint)


def target_gpu(recipe: Recipe) -> GPUSpec | None:
    """The GPU a recipe names (None when it names none or an unknown one)."""
    return lookup_gpu(recipe.hardware.gpu) if recipe.hardware.gpu else None


@rule
def known_gpu(r: Recipe) -> Iterator[Problem]:
    if r.hardware.gpu and lookup_gpu(r.hardware.gpu) is None:
        yield err("hardware.gpu", f"unknown GPU {r.hardware.gpu!r}",
                  "known GPUs: " + ", ".join(known_gpu_names()))


@rule
def format_vs_target(r: Recipe) -> Iterator[Problem]:
    """The format registry's verdict (kiln.recipe.formats) for the recipe's target and GPU: the same answer
    `kiln plan` and the engine step give."""
    gpu = target_gpu(r)
    sm, name = (gpu.sm, gpu.name) if gpu else (None, None)
    for key, refusal in (("quantization.format", format_refusal(r.quantization.format, r.target, sm, name)),
                         ("quantization.kv_cache", kv_refusal(r.quantization.kv_cache, r.target, sm, name))):
        if refusal is not None:
            yield err(key, refusal.reason, refusal.hint)


@rule
def format_vs_release(r: Recipe) -> Iterator[Problem]:
    """Target pytorch: the formats the chosen TensorRT-LLM release's PyTorch backend runs (the registry's
    pytorch_releases), naming the release."""
    if r.target != "pytorch":
        return
    from kiln.recipe.formats import release_refusal

    for key, refusal in release_refusal(r.quantization.format, r.quantization.kv_cache,
                                        r.engine_runtime.trtllm_version.strip()):
        yield err(key, refusal.reason, refusal.hint)


@rule
def reference_target_limits(r: Recipe) -> Iterator[Problem]:
    if r.target == "reference" and r.parallelism.tp * r.parallelism.pp > 1:
        yield err("parallelism", "the reference target runs one CPU process (tp = pp = 1)",
                  "set parallelism.tp: 1 and parallelism.pp: 1, or target: tensorrt")
    if r.target == "pytorch" and r.serving.llmapi_runtime == "reference" and r.parallelism.tp * r.parallelism.pp > 1:
        yield err("serving.llmapi_runtime", "the CPU reference runtime of the llmapi model runs one process "
                  "(tp = pp = 1)", "set serving.llmapi_runtime: tensorrt_llm (or auto), or tp and pp to 1")
    if r.serving.cuda_graphs and (r.target == "reference" or (r.target == "pytorch"
                                                               and r.serving.llmapi_runtime == "reference")):
        yield warn("serving.cuda_graphs", "the reference runtimes run on the CPU: CUDA graphs have no effect there")


#: Recipe values TensorRT-LLM's PyTorch backend (target pytorch) needs: dotted key → (the value, why).
PYTORCH_REQUIRES: dict[str, tuple[object, str]] = {
    "serving.batching": ("inflight_fused", "the PyTorch backend only batches in flight (there is no static v1 "
                         "batching)"),
    "engine.kv_cache_type": ("paged", "the PyTorch backend's KV cache is always paged"),
    "serving.gpu_device_ids": (None, "the LLM API uses every GPU the process sees: choose them with "
                               "CUDA_VISIBLE_DEVICES where the server starts"),
    "serving.add_special_tokens": (True, "the LLM API's tokenizer adds the special tokens; the llmapi model has no "
                                   "switch for it"),
    "serving.skip_special_tokens": (True, "the LLM API's detokenizer skips the special tokens; the llmapi model has "
                                    "no switch for it"),
}


@rule
def pytorch_backend(r: Recipe) -> Iterator[Problem]:
    """What TensorRT-LLM's PyTorch backend (target pytorch) does not have: static batching, a non-paged KV cache,
    per-model GPU lists and special-token switches, and serving across nodes from kiln's deploy files."""
    if r.target != "pytorch":
        return
    for key, (value, why) in PYTORCH_REQUIRES.items():
        if dotted_attr(r, key) != value:
            yield err(key, why, f"set {key}: {'empty' if value is None else str(value).lower()} (or target: tensorrt)")
    ranks = r.parallelism.tp * r.parallelism.pp
    if ranks > r.hardware.gpus_per_node:
        yield err("parallelism", f"tp × pp = {ranks} spans several nodes (hardware.gpus_per_node "
                  f"{r.hardware.gpus_per_node}): kiln packages the llmapi model for one node, where the LLM API "
                  "spawns its ranks itself", "fit tp × pp on one node, or use target: tensorrt for multi-node "
                  "serving")


@rule
def gpu_count(r: Recipe) -> Iterator[Problem]:
    ranks = r.parallelism.tp * r.parallelism.pp
    if r.hardware.count is not None and ranks > r.hardware.count:
        yield err("parallelism", f"tp × pp = {ranks} ranks but hardware.count is {r.hardware.count}",
                  f"lower tp/pp or set hardware.count to at least {ranks}")
    if r.serving.gpu_device_ids is not None and len(r.serving.gpu_device_ids) < ranks:
        yield err("serving.gpu_device_ids", f"{len(r.serving.gpu_device_ids)} device ids for {ranks} ranks",
                  f"list {ranks} GPU ids or leave it empty")


@rule
def seq_limits(r: Recipe) -> Iterator[Problem]:
    b = r.engine
    if b.max_seq_len is not None and b.max_seq_len < b.max_input_len:
        yield err("engine.max_seq_len", f"max_seq_len ({b.max_seq_len}) is less than max_input_len "
                  f"({b.max_input_len}): no room for a full prompt",
                  f"set engine.max_seq_len ≥ {b.max_input_len} (prompt + output tokens)")
    elif b.max_seq_len is not None and b.max_seq_len == b.max_input_len:
        yield warn("engine.max_seq_len", "max_seq_len equals max_input_len: a full-length prompt leaves no room "
                   "for output tokens", "raise engine.max_seq_len")
    if b.max_num_tokens < b.max_input_len and not r.serving.enable_chunked_context:
        yield err("engine.max_num_tokens", f"max_num_tokens ({b.max_num_tokens}) is less than max_input_len "
                  f"({b.max_input_len}) without chunked context: the longest prompts can never be scheduled",
                  f"raise engine.max_num_tokens to ≥ {b.max_input_len} or set serving.enable_chunked_context: true")
    if b.tokens_per_block & (b.tokens_per_block - 1):
        yield err("engine.tokens_per_block", f"{b.tokens_per_block} is not a power of two",
                  "use 16, 32, 64 or 128")


@rule
def kv_features(r: Recipe) -> Iterator[Problem]:
    b, s = r.engine, r.serving
    paged = b.kv_cache_type == "paged"
    if s.batching == "inflight_fused" and not paged:
        yield err("engine.kv_cache_type", "in-flight batching needs a paged KV cache",
                  "set engine.kv_cache_type: paged, or serving.batching: v1")
    if s.batching == "inflight_fused" and not b.remove_input_padding:
        yield err("engine.remove_input_padding", "in-flight batching needs packed inputs",
                  "set engine.remove_input_padding: true")
    kv = kv_cache_format(r.quantization.kv_cache)
    keeps_fmha = ", ".join(n for n in kv_cache_format_names() if not kv_cache_format(n).disables_paged_context_fmha)
    no_paged_ctx = kv.disables_paged_context_fmha
    for key, on in ((("serving.enable_kv_cache_reuse", s.enable_kv_cache_reuse),
                     ("serving.enable_chunked_context", s.enable_chunked_context)) if r.target != "pytorch" else ()):
        what = key.split(".")[1]
        if on and (not b.use_paged_context_fmha or not b.context_fmha or not paged):
            yield err(key, f"{what} needs paged context FMHA over a paged KV cache",
                      "set engine.use_paged_context_fmha: true (and context_fmha: true, kv_cache_type: paged), "
                      f"or {key}: false")
        elif on and no_paged_ctx:
            yield warn(key, f"an {kv.label} turns paged context FMHA off, so {what} will not take effect",
                       f"use a quantization.kv_cache that keeps it ({keeps_fmha}), or {key}: false")
    if no_paged_ctx and b.use_paged_context_fmha and r.target == "tensorrt":
        yield warn("engine.use_paged_context_fmha", "TensorRT-LLM silently disables paged context FMHA with an "
                   f"{kv.label} (no KV reuse, no chunked context)",
                   f"use a quantization.kv_cache that keeps it ({keeps_fmha}), or accept it")
    if b.use_fp8_context_fmha and not weight_format(r.quantization.format).fp8_context_fmha and r.target != "pytorch":
        yield warn("engine.use_fp8_context_fmha", "FP8 context FMHA only takes effect with an FP8 format "
                   f"(format is {r.quantization.format})", "set engine.use_fp8_context_fmha: false")
    if r.target == "reference" and r.quantization.kv_cache != "none":
        yield warn("quantization.kv_cache", "the reference runtime quantizes K/V with ModelOpt fake-quant but "
                   "stores its paged cache in the model dtype; the memory saving shows only on the tensorrt target")


@rule
def speculative(r: Recipe) -> Iterator[Problem]:
    sp = r.engine.speculative
    if sp.mode == "none":
        if sp.max_draft_len:
            yield err("engine.speculative.max_draft_len", "max_draft_len is set but speculative decoding is off",
                      "set engine.speculative.mode or max_draft_len: 0")
        if sp.draft_recipe:
            yield err("engine.speculative.draft_recipe", "a draft recipe is set but speculative decoding is off",
                      "set engine.speculative.mode: draft_tokens_external")
        return
    if sp.max_draft_len < 1:
        yield err("engine.speculative.max_draft_len", f"speculative mode {sp.mode} needs max_draft_len ≥ 1",
                  "e.g. max_draft_len: 4 (draft+target) or 63 (medusa/eagle trees)")
    if sp.mode == "draft_tokens_external" and not sp.draft_recipe:
        yield err("engine.speculative.draft_recipe", "draft_tokens_external needs a draft model recipe",
                  "set engine.speculative.draft_recipe: <path to the draft recipe>")
    if sp.mode != "draft_tokens_external" and sp.draft_recipe:
        yield err("engine.speculative.draft_recipe", f"mode {sp.mode} does not use a separate draft recipe",
                  "remove draft_recipe, or use mode: draft_tokens_external")
    if r.engine.max_beam_width != 1:
        yield err("engine.max_beam_width", "speculative decoding needs max_beam_width: 1")
    if sp.mode in ("medusa", "eagle", "lookahead_decoding", "explicit_draft_tokens") and r.target == "reference":
        yield err("engine.speculative.mode", f"{sp.mode} needs its own trained heads in a TensorRT-LLM engine; "
                  "the reference target supports only draft_tokens_external")
    if sp.mode in ("ngram", "mtp") and r.target != "pytorch":
        yield err("engine.speculative.mode", f"{sp.mode} is a mode of TensorRT-LLM's PyTorch backend only",
                  "set target: pytorch, or another engine.speculative.mode")
    if sp.mode in ("medusa", "lookahead_decoding", "explicit_draft_tokens") and r.target == "pytorch":
        yield err("engine.speculative.mode", f"TensorRT-LLM 1.2.1's PyTorch backend does not run {sp.mode} (the "
                  "LLM API's config for it supports the TensorRT backend only)",
                  "use draft_tokens_external, eagle (EAGLE3), ngram or mtp, or target: tensorrt")
    if sp.mode == "eagle" and r.target == "pytorch" and not sp.draft_model:
        yield err("engine.speculative.draft_model", "eagle on the pytorch target needs the EAGLE3 draft head",
                  "set engine.speculative.draft_model: <directory or hf:org/name of the EAGLE3 head>")
    if sp.draft_model and not (sp.mode == "eagle" and r.target == "pytorch"):
        yield err("engine.speculative.draft_model", "draft_model is the EAGLE3 head of mode eagle on target pytorch",
                  "remove it, or set engine.speculative.mode: eagle and target: pytorch")
    if sp.mode == "draft_tokens_external" and not r.engine.use_paged_context_fmha and r.target != "pytorch":
        yield err("engine.use_paged_context_fmha", "draft_tokens_external needs paged context FMHA")
    if r.engine.max_seq_len is not None and sp.max_draft_len and r.target != "pytorch":
        yield warn("engine.max_seq_len", f"TensorRT-LLM adds max_draft_len ({sp.max_draft_len}) to max_seq_len "
                   f"(engine max_seq_len will be {r.engine.max_seq_len + sp.max_draft_len})")


@rule
def calibration(r: Recipe) -> Iterator[Problem]:
    q = r.quantization
    c = q.calibration
    if q.format == "none" and q.kv_cache == "none":
        return
    cap = weight_format(q.format).calibration.max_samples
    if cap is not None and c.samples > cap:
        yield warn("quantization.calibration.samples", f"{weight_format(q.format).label} calibrates on at most "
                   f"{cap} samples (as upstream); {c.samples} asked", f"set samples: {cap} to say what runs")
    if c.batch_size > c.samples:
        yield err("quantization.calibration.batch_size", f"batch_size ({c.batch_size}) exceeds samples "
                  f"({c.samples})", "lower batch_size")


@rule
def engine_runtime(r: Recipe) -> Iterator[Problem]:
    rt = r.engine_runtime
    uses = r.target == "tensorrt" or quantization_runtime(r) == "engine"
    if r.quantization.runtime == "engine" and r.target == "reference":
        yield err("quantization.runtime", "the reference target runs on the CPU with kiln's own ModelOpt; it has no "
                  "engine runtime", "set quantization.runtime: host (or auto)")
    if r.target == "tensorrt" and not has_engine_path(rt.trtllm_version):
        yield err("engine_runtime.trtllm_version", f"TensorRT-LLM {rt.trtllm_version} has no TensorRT engine path "
                  f"(upstream removed trtllm-build and Triton's tensorrtllm backend after {LAST_ENGINE_VERSION}): "
                  f"{LAST_ENGINE_VERSION} is the last version kiln builds engines with",
                  f"serve it on the PyTorch backend: --set target=pytorch (or keep target: tensorrt with "
                  f"engine_runtime.trtllm_version: {LAST_ENGINE_VERSION})")
        return
    if not uses:
        return
    if rt.kind == "container" and rt.trtllm_version not in JOB_CONTAINERS:
        known = ", ".join(JOB_CONTAINERS)
        if rt.image is None:
            yield err("engine_runtime.trtllm_version", f"no container in kiln's table ships TensorRT-LLM "
                      f"{rt.trtllm_version!r}", f"use one of {known}, or name the image with engine_runtime.image")
        else:
            yield warn("engine_runtime.trtllm_version", f"kiln's container table does not know TensorRT-LLM "
                       f"{rt.trtllm_version!r}: the TensorRT version in {rt.image} is not checked",
                       f"known: {known}")
    if rt.gpus != "all" and not all(part.strip().isdigit() for part in rt.gpus.split(",")):
        yield err("engine_runtime.gpus", f"{rt.gpus!r} is neither `all` nor GPU indices", "e.g. all, 0, or 0,1")
    if rt.kind == "local" and rt.image is not None:
        yield warn("engine_runtime.image", "kind: local runs no container: the image is not used",
                   "remove engine_runtime.image, or set engine_runtime.kind: container")
    if r.target == "tensorrt" and quantization_runtime(r) == "host":
        yield warn("quantization.runtime", "the checkpoint trtllm-build reads is exported by kiln's own ModelOpt, "
                   f"not the one TensorRT-LLM {rt.trtllm_version} was made with",
                   "for an engine you will serve, quantize in the engine runtime (quantization.runtime: engine); "
                   "host is for calibrating and gating on a machine without a GPU")


@rule
def deployment(r: Recipe) -> Iterator[Problem]:
    if r.target != "tensorrt":
        return
    ranks = r.parallelism.tp * r.parallelism.pp
    multi_node = ranks > r.hardware.gpus_per_node
    sp = r.engine.speculative
    if multi_node and sp.mode == "draft_tokens_external":
        yield err("engine.speculative.mode", f"draft+target decoding with tp × pp = {ranks} > hardware.gpus_per_node "
                  f"({r.hardware.gpus_per_node}): TensorRT-LLM's orchestrator mode, which a draft+target pair with "
                  "tp × pp > 1 needs, spawns its ranks on one node only",
                  "fit the pair on one node (lower tp × pp), or drop speculative decoding for a multi-node model")
    if multi_node and not r.serving.multinode_image:
        yield warn("serving.multinode_image", f"tp × pp = {ranks} spans several nodes: the LeaderWorkerSet pods need "
                   "the serving image plus sshd, which the stock NGC image lacks",
                   "build deploy/<recipe>/Dockerfile.multinode (kiln writes it), push it, and set "
                   "serving.multinode_image to the pushed name")


def check_rules(recipe: Recipe) -> list[Problem]:
    """Run every rule; errors first, then warnings."""
    found = [p for fn in RULES for p in fn(recipe)]
    return sorted(found, key=lambda p: p.severity != "error")


@rule
def init_image(r: Recipe) -> Iterator[Problem]:
    gpu_deploy = r.target == "tensorrt" or (r.target == "pytorch" and r.serving.llmapi_runtime == "tensorrt_llm")
    if gpu_deploy and r.cache.remote and r.serving.init_image is None:
        yield warn("serving.init_image", "the deploy files' init step, which pulls the packaged repository from "
                   "cache.remote into each pod, runs kiln-init:<version>, an image you build and that is not pinned "
                   "by digest", "build deploy/<recipe>/Dockerfile.init (kiln writes it), push it, and set "
                   "serving.init_image to name@sha256:…")
