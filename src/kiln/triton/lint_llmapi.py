"""`kiln lint` for Triton llmapi repositories (target pytorch, or made by hand from upstream's all_models/llmapi).

A repository is llmapi-shaped when its ``tensorrt_llm`` model is a Python model with a ``1/model.yaml``. Checks:
model.yaml parses; its ``triton_config`` is what the pinned llmapi model reads (``decoupled``, ``max_batch_size`` 0)
and config.pbtxt says the same (a server started with ``--disable-auto-complete-config`` serves config.pbtxt, and
upstream's auto_complete_config would overwrite it with triton_config otherwise: either way a disagreement means
the repository does not do what one of them says); every other key is an LLM argument of the TensorRT-LLM release
kiln.json records (``llm_args_version``; 1.2.1 for a repository without one) with a value of its type; the tensors
are the llmapi contract's; the checkpoint ``model`` names exists and its ``hf_quant_config.json`` names a format the
PyTorch backend runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional

import yaml
from tritonclient.grpc import model_config_pb2

from kiln.recipe.formats import format_refusal, kv_refusal, registry, release_refusal
from kiln.triton.lint import CONTAINER_MODEL_ROOT, TRTLLM_MODEL, Finding, Model
from kiln.triton.repository import PROMPT_SCORING
from kiln.triton.llmapi import (
    DEFAULT_LLM_ARGS_VERSION,
    MODEL_YAML,
    check_llm_args,
    check_triton_config,
    contract_tensors,
    llm_args_versions,
    llmapi_model_data,
)


def is_llmapi(models: dict[str, Model]) -> bool:
    m = models.get(TRTLLM_MODEL)
    return bool(m is not None and m.config is not None and m.config.backend == "python"
                and (m.dir / "1" / MODEL_YAML).is_file())


def _line(text: str, key: str) -> Optional[int]:
    """1-based line of the first ``key:`` in a YAML text (the last part of a dotted key)."""
    leaf = key.split(".")[-1]
    rx = re.compile(rf"^\s*{re.escape(leaf)}\s*:")
    return next((i for i, line in enumerate(text.splitlines(), 1) if rx.search(line)), None)


def _checkpoint(value: object, m: Model, repo: Path) -> Optional[Path]:
    if not isinstance(value, str) or not value:
        return None
    p = Path(value)
    if value.startswith(CONTAINER_MODEL_ROOT + "/"):
        mapped = repo / value[len(CONTAINER_MODEL_ROOT) + 1:]
        if mapped.exists():
            return mapped
    return p if p.is_absolute() else m.dir / "1" / p


def _quantization(m: Model, file: str, line: Optional[int], ckpt: Path, version: str) -> Iterable[Finding]:
    """The checkpoint's hf_quant_config.json against the pytorch target's support and TensorRT-LLM ``version``'s (the
    format registry)."""
    path = ckpt / "hf_quant_config.json"
    if not path.is_file():
        return
    try:
        quant = json.loads(path.read_text(encoding="utf-8")).get("quantization") or {}
    except ValueError as exc:
        yield Finding("error", m.name, str(path), None, f"unreadable: {exc}", "re-export the checkpoint")
        return
    reg = registry()
    weight = next((f.name for f in reg.weight_formats.values() if f.quant_algo == quant.get("quant_algo")), None)
    kv = next((f.name for f in reg.kv_cache_formats.values()
               if f.kv_cache_quant_algo == quant.get("kv_cache_quant_algo")), None)
    if quant.get("quant_algo") is not None and weight is None:
        yield Finding("warning", m.name, str(path), None, f"quant_algo {quant.get('quant_algo')!r} is not a format "
                      "kiln knows; the PyTorch backend decides at load", "")
    for name, refusal in ((weight, format_refusal(weight, "pytorch") if weight else None),
                          (kv, kv_refusal(kv, "pytorch") if kv else None)):
        if refusal is not None:
            yield Finding("error", m.name, file, line, f"the checkpoint is {name}: {refusal.reason}", refusal.hint)
    for key, refusal in release_refusal(weight or "none", kv or "none", version):
        if key != "engine_runtime.trtllm_version":  # an unknown release is _args_version's finding
            yield Finding("error", m.name, file, line, f"the checkpoint is {weight if 'format' in key else kv}: "
                          f"{refusal.reason}", refusal.hint)


def check_llmapi(m: Model, repo: Path, kiln_info: dict) -> list[Finding]:
    """Every finding for the llmapi model ``m``."""
    findings: list[Finding] = []
    path = m.dir / "1" / MODEL_YAML
    file = str(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        return [Finding("error", m.name, file, mark.line + 1 if mark else None, f"not valid YAML: {exc}",
                        "fix the YAML (the llmapi model refuses to load it)")]
    if not isinstance(data, dict):
        return [Finding("error", m.name, file, None, "model.yaml is not a mapping of LLM arguments",
                        "write `key: value` lines: the LLM arguments and triton_config")]
    for problem in check_triton_config(data.get("triton_config")):
        key = problem.split(":", 1)[0]
        findings.append(Finding("error", m.name, file, _line(text, key) or _line(text, "triton_config"), problem,
                                "set triton_config.max_batch_size: 0 and triton_config.decoupled: true|false"))
    version, problem = _args_version(kiln_info)
    if problem is not None:
        findings.append(Finding("error", m.name, str(repo / "kiln.json"), None, problem,
                                f"package again with a version kiln has a table for ({', '.join(llm_args_versions())})"))
    for problem in check_llm_args({k: v for k, v in data.items() if k != "triton_config"}, version):
        key = problem.split(":", 1)[0]
        findings.append(Finding("error", m.name, file, _line(text, key), problem,
                                f"use the LLM argument's name and type (kiln/triton/data/llm_args/{version}.yaml, "
                                f"from TensorRT-LLM {version}'s llm_args.py); upstream refuses unknown keys at load"))
    tc = data.get("triton_config") if isinstance(data.get("triton_config"), dict) else {}
    cfg_file = str(m.config_path)
    if "max_batch_size" in tc and m.config.max_batch_size != tc["max_batch_size"]:
        findings.append(Finding("error", m.name, cfg_file, m.line_of(r"^\s*max_batch_size\s*:"),
                                f"max_batch_size is {m.config.max_batch_size} but model.yaml triton_config says "
                                f"{tc['max_batch_size']}",
                                f"set max_batch_size: {tc['max_batch_size']} in config.pbtxt (the server serves "
                                "config.pbtxt with --disable-auto-complete-config)"))
    if "decoupled" in tc and m.decoupled != bool(tc["decoupled"]):
        findings.append(Finding("error", m.name, cfg_file, m.line_of("model_transaction_policy"),
                                f"decoupled is {m.decoupled} but model.yaml triton_config.decoupled is "
                                f"{bool(tc['decoupled'])}", "make config.pbtxt's model_transaction_policy agree"))
    findings += _tensors(m)
    ckpt = _checkpoint(data.get("model"), m, repo)
    line = _line(text, "model")
    if ckpt is None:
        findings.append(Finding("error", m.name, file, line, "model is not set", "name the unified checkpoint"))
    elif not ckpt.exists() and re.fullmatch(r"[\w.\-]+/[\w.\-]+", str(data["model"])):
        findings.append(Finding("warning", m.name, file, line, f"model {data['model']!r} is a hub id: the server "
                                "downloads it when it starts (and kiln cannot check its quantization)",
                                "package a local checkpoint for reproducible serving"))
    elif not (ckpt / "config.json").is_file():
        findings.append(Finding("error", m.name, file, line, f"checkpoint {ckpt} has no config.json",
                                "copy the unified checkpoint there (kiln package does) or fix model"))
    else:
        findings += _quantization(m, file, line, ckpt, version)
    if not (m.dir / "1" / "model.py").is_file():
        findings.append(Finding("error", m.name, str(m.dir / "1"), None, "no model.py",
                                "ship the llmapi model.py (kiln's, or upstream's all_models/llmapi)"))
    return findings


def _args_version(kiln_info: dict) -> tuple[str, Optional[str]]:
    """The TensorRT-LLM release whose LLM arguments the repository is checked against: the ``llm_args_version``
    kiln.json records (a repository made by hand, without one: 1.2.1, the Triton image's), and the problem when
    kiln has no table for the recorded one (then 1.2.1's table is used)."""
    recorded = kiln_info.get("llm_args_version") if isinstance(kiln_info, dict) else None
    if recorded is None:
        return DEFAULT_LLM_ARGS_VERSION, None
    if str(recorded) not in llm_args_versions():
        return DEFAULT_LLM_ARGS_VERSION, (f"kiln.json records llm_args_version {recorded!r}, a TensorRT-LLM release "
                                          f"kiln has no LLM-argument table for (checked against "
                                          f"{DEFAULT_LLM_ARGS_VERSION}'s instead)")
    return str(recorded), None


def _tensors(m: Model) -> Iterable[Finding]:
    """config.pbtxt's tensors against the pinned llmapi contract."""
    file = str(m.config_path)
    contract = {"input": {t.name: t for t in contract_tensors("inputs")},
                "output": {t.name: t for t in contract_tensors("outputs")}}
    # kiln's prompt-scoring extension (declared by kiln's own llmapi model.py, optional: upstream's clients never
    # send it) is not upstream's contract but is no stray tensor either
    extension = {"input": {PROMPT_SCORING[0]}, "output": {name for name, _ in PROMPT_SCORING[1]}}
    for kind in ("input", "output"):
        declared = {t.name: t for t in getattr(m.config, kind)}
        for name, t in declared.items():
            want = contract[kind].get(name)
            if want is None and name in extension[kind]:
                continue
            line = m.line_of(rf'name:\s*"{re.escape(name)}"')
            if want is None:
                yield Finding("warning", m.name, file, line, f"{kind} {name!r} is not in the llmapi contract of "
                              f"TensorRT-LLM 1.2.1 (source: {llmapi_model_data()['sources']['config']['path']})",
                              "remove it, or check the name")
                continue
            got_type = model_config_pb2.DataType.Name(t.data_type)
            if got_type != want.data_type or tuple(t.dims) != want.dims:
                yield Finding("error", m.name, file, line, f"{kind} {name} is {got_type} {list(t.dims)}, the llmapi "
                              f"contract says {want.data_type} {list(want.dims)}",
                              f"declare {want.data_type} dims {list(want.dims)}")
        if kind == "input" and "text_input" not in declared:
            yield Finding("error", m.name, file, m.line_of(r"^\s*input\s*\["), "no text_input input",
                          "declare text_input TYPE_STRING dims [-1]")
        if kind == "output" and "text_output" not in declared:
            yield Finding("error", m.name, file, m.line_of(r"^\s*output\s*\["), "no text_output output",
                          "declare text_output TYPE_STRING dims [-1]")
