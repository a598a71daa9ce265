"""Write the Triton repository of target pytorch: Triton's ``llmapi`` layout, one Python model ``tensorrt_llm``
configured by ``model.yaml``, and the trtllm-serve files for the same checkpoint and LLM arguments.

Layout (``triton_repo/<recipe>/``)::

    tensorrt_llm/config.pbtxt        upstream's llmapi tensors; max_batch_size / decoupled as triton_config says
    tensorrt_llm/1/model.yaml        the LLM arguments (checked against TensorRT-LLM 1.2.1's) + triton_config
    tensorrt_llm/1/model.py          kiln's llmapi model (GPU LLM API, or the CPU reference runtime)
    tensorrt_llm/1/kiln_dequantize.json  the reference runtime's dequantization layouts (from the format registry)
    tensorrt_llm/1/checkpoint/       ModelOpt's unified Hugging Face checkpoint (hard links)
    tensorrt_llm/1/draft_checkpoint/ the draft model's, for draft-target speculative decoding
    tensorrt_llm/1/eagle_head/       a local EAGLE3 head (engine.speculative.draft_model), for mode eagle
    kiln.json                        recipe, fingerprint, runtime, serving container, server and trtllm-serve commands

``deploy/<recipe>/trtllm-serve/``: ``llm_options.yaml`` (the same LLM arguments, for ``--extra_llm_api_options``)
and ``serve.sh`` (the command line), beside the Triton deploy files.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any, Optional

from kiln.recipe.containers import container_for, row_for, strip_digest
from kiln.recipe.schema import Recipe, llmapi_runtime
from kiln.triton.deploy.info import CONTAINER_REPO
from kiln.triton.llmapi import (
    CHECKPOINT_DIR,
    DEQUANTIZE_FILE,
    DRAFT_DIR,
    EAGLE_DIR,
    MODEL_NAME,
    MODEL_YAML,
    DEFAULT_LLM_ARGS_VERSION,
    check_llm_args,
    container_llm_args,
    llm_args_version,
    check_triton_config,
    dequantize_table,
    dump_yaml,
    model_yaml,
    render_config,
    trtllm_serve_command,
    trtllm_serve_options,
)
from kiln.triton.repository import install_python_model, serving_record
from kiln.util.artifacts import link_tree
from kiln.util.errors import KilnError

LLMAPI_SOURCE = "llmapi"  # kiln's model directory (src/kiln/triton/models/llmapi/)
SERVE_DIR = "trtllm-serve"
OPTIONS_FILE = "llm_options.yaml"
REFERENCE_RUNTIME = ("reference: kiln's CPU runtime for Triton's llmapi tensor contract, loading the unified "
                     "checkpoint (a test and development vehicle, not the fast path)")
GPU_RUNTIME = "pytorch: TensorRT-LLM's LLM API (PyTorch backend) loading ModelOpt's unified checkpoint"


def _header(recipe: Recipe) -> str:
    return (f"# model.yaml of kiln recipe {recipe.name!r} (target pytorch), read by tensorrt_llm/1/model.py.\n"
            f"# Every key but triton_config is an LLM argument of TensorRT-LLM {recipe.engine_runtime.trtllm_version} "
            "(tensorrt_llm.LLM); paths are\n"
            "# relative to this directory. Written by kiln: change the recipe and package again.")


def check_model_yaml(data: dict[str, Any], version: str = DEFAULT_LLM_ARGS_VERSION) -> list[str]:
    """The problems of a whole model.yaml: its LLM arguments (TensorRT-LLM ``version``'s) and its triton_config."""
    args = {k: v for k, v in data.items() if k != "triton_config"}
    return check_llm_args(args, version) + check_triton_config(data.get("triton_config"))


def serving_container(recipe: Recipe, image: Optional[str] = None, digest: Optional[str] = None) -> str:
    """The NGC image that serves the repository: the recipe's engine runtime image, else the table's for its
    TensorRT-LLM version, pinned by digest when known."""
    container = image or recipe.engine_runtime.image or container_for(recipe.engine_runtime.trtllm_version)
    if digest and "@" not in container:
        container = f"{strip_digest(container)}@{digest}"
    return container


def write_llmapi_repository(recipe: Recipe, checkpoint: Path, out: Path, max_seq_len: Optional[int], *,
                            final: Optional[Path] = None, fingerprint: str = "", quality: Optional[dict] = None,
                            draft_checkpoint: Optional[Path] = None, eagle_head: Optional[Path] = None,
                            image: Optional[str] = None, image_digest: Optional[str] = None) -> dict[str, Any]:
    """Write the llmapi repository into ``out`` (renamed to ``final`` when complete); returns kiln.json's content.
    The model.yaml it writes is checked against the pinned LLM arguments before anything else is written."""
    runtime = llmapi_runtime(recipe)
    data = model_yaml(recipe, max_seq_len, draft=draft_checkpoint is not None, eagle_head=eagle_head is not None)
    args_version = llm_args_version(recipe)
    problems = check_model_yaml(data, args_version)
    if problems:
        raise KilnError(f"the model.yaml kiln would write is not what TensorRT-LLM {args_version} takes:\n  "
                        + "\n  ".join(problems))
    model = out / MODEL_NAME
    version = model / "1"
    version.mkdir(parents=True)
    (model / "config.pbtxt").write_text(render_config(recipe, runtime), encoding="utf-8")
    (version / MODEL_YAML).write_text(dump_yaml(data, _header(recipe)), encoding="utf-8")
    install_python_model(LLMAPI_SOURCE, model)
    (version / DEQUANTIZE_FILE).write_text(json.dumps(dequantize_table(), indent=2) + "\n", encoding="utf-8")
    link_tree(checkpoint, version / CHECKPOINT_DIR)
    if draft_checkpoint is not None:
        link_tree(draft_checkpoint, version / DRAFT_DIR)
    if eagle_head is not None:
        link_tree(eagle_head, version / EAGLE_DIR)

    from kiln.triton.deploy import DeployInfo, server_command

    container = serving_container(recipe, image, image_digest) if runtime == "tensorrt_llm" else None
    root = CONTAINER_REPO if container else str(final or out)
    command = server_command(DeployInfo.from_recipe(recipe, container or "kiln-reference"), root)
    row = row_for(container) if container else None
    stacks = list(row.stacks) if row is not None else None
    if stacks is not None and "triton-llmapi" not in stacks:
        command = []  # no tritonserver in this image (TensorRT-LLM after 1.2.1): kiln.json names none
    args = {k: v for k, v in data.items() if k != "triton_config"}
    info = {
        "kiln_repository_version": 2,
        "recipe": recipe.name,
        "fingerprint": fingerprint,
        "target": "pytorch",
        "layout": "llmapi",
        "llmapi_runtime": runtime,
        "runtime": REFERENCE_RUNTIME if runtime == "reference" else GPU_RUNTIME,
        # no engine: nothing for the engine check to compare (launch.sh and kiln serve skip it)
        "engine": {"tensorrt_llm": None, "tensorrt": None, "image": image, "image_digest": image_digest,
                   "max_batch_size": recipe.engine.max_batch_size, "max_input_len": recipe.engine.max_input_len,
                   "max_seq_len": max_seq_len},
        "serving_tensorrt_llm": recipe.engine_runtime.trtllm_version if container else None,
        "container": container,
        "streaming": recipe.serving.streaming,
        "world_size": recipe.parallelism.tp * recipe.parallelism.pp,
        "tensorrt_llm_models": [MODEL_NAME],
        "orchestrator": False,
        "models": sorted(p.name for p in out.iterdir() if p.is_dir()),
        "server_command": command,
        "check_command": [],
        # the serving stacks the container carries (kiln's container table; None: the table does not know it)
        "stacks": stacks,
        "llm_args": args,
        "llm_args_version": args_version,
        "trtllm_serve_command": trtllm_serve_command(recipe, f"{CONTAINER_REPO}/{MODEL_NAME}/1/{CHECKPOINT_DIR}",
                                                     f"{SERVE_DIR}/{OPTIONS_FILE}"),
        "quality": quality,
        "serving": serving_record(recipe),
    }
    (out / "kiln.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return info


def write_trtllm_serve_files(recipe: Recipe, info: dict[str, Any], deploy_dir: Path) -> list[Path]:
    """``trtllm-serve/llm_options.yaml`` and ``trtllm-serve/serve.sh`` in the deploy directory: trtllm-serve with the
    repository's checkpoint and LLM arguments (its OpenAI-compatible endpoints on serving.http_port)."""
    serve_dir = deploy_dir / SERVE_DIR
    if serve_dir.exists():
        shutil.rmtree(serve_dir)
    serve_dir.mkdir(parents=True)
    options = trtllm_serve_options(container_llm_args(dict(info["llm_args"]), CONTAINER_REPO))
    version = llm_args_version(recipe)
    problems = check_llm_args({**options, "model": "checkpoint"}, version)
    if problems:
        raise KilnError(f"the trtllm-serve options kiln would write are not TensorRT-LLM {version}'s:\n  "
                        + "\n  ".join(problems))
    options_file = serve_dir / OPTIONS_FILE
    options_file.write_text(dump_yaml(options, f"# trtllm-serve --extra_llm_api_options for kiln recipe "
                                               f"{recipe.name!r}: the LLM arguments of tensorrt_llm/1/model.yaml"),
                            encoding="utf-8")
    command = trtllm_serve_command(recipe, '"${MODEL_REPO}/' + f'{MODEL_NAME}/1/{CHECKPOINT_DIR}"',
                                   '"$(dirname "$0")/' + f'{OPTIONS_FILE}"')
    quoted = " ".join(w if w.startswith('"') else shlex.quote(w) for w in command)
    script = serve_dir / "serve.sh"
    script.write_text("\n".join([
        "#!/usr/bin/env bash",
        f"# trtllm-serve for kiln recipe {recipe.name!r}: the same unified checkpoint and LLM arguments as the Triton",
        "# llmapi model, served by TensorRT-LLM's OpenAI-compatible server (/v1/completions, /v1/chat/completions,",
        f"# /health, /metrics) on port {recipe.serving.http_port}. Run it in {info['container'] or 'the NGC image'}"
        " with the repository",
        f"# mounted at {CONTAINER_REPO} (or set MODEL_REPO). Written by kiln: change the recipe and package again.",
        "set -euo pipefail",
        f'MODEL_REPO="${{MODEL_REPO:-{CONTAINER_REPO}}}"',
        "exec " + quoted,
        "",
    ]), encoding="utf-8")
    script.chmod(0o755)
    return [options_file, script]
