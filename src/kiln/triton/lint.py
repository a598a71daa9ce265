"""`kiln lint REPO`: check a Triton TensorRT-LLM model repository without a GPU.

Works on kiln's repositories and on ones made by hand from upstream's templates. Each finding names the model,
the file, the line and the fix. Checks: every config.pbtxt parses into Triton's own schema
(`model_config_pb2.ModelConfig`); an unfilled `${…}` parameter is an error where upstream's model reads it
with no fallback and a warning naming the default otherwise (`data/upstream_parameters.yaml`, read from
tensorrtllm_backend@c2e65b8); an absolute path outside the repository that this machine lacks is a warning (the
serving container's); ensemble steps name existing models and
tensors with matching types; streaming needs decoupled models; limits and KV-cache features agree with the
engine's `config.json`; the tokenizer is present and loads; the engine's TensorRT-LLM version is the one the
serving container in `kiln.json` ships. Triton llmapi repositories (target pytorch) get their own checks
(:mod:`kiln.triton.lint_llmapi`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal, Optional

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kiln.recipe.formats import kv_format_for_quant_algo
from kiln.triton.models.kiln_triton_utils import parse_bool, parse_int
from kiln.triton.upstream import LOGITS_TRITON_TYPE, NGC_CONTAINERS

CONTAINER_MODEL_ROOT = "/models"  # where kiln's deploy files mount the repository in the serving container
PLACEHOLDER = re.compile(r"\$\{[^}]*\}")
TRTLLM_MODEL = "tensorrt_llm"


@dataclass(frozen=True)
class Finding:
    severity: Literal["error", "warning"]
    model: str
    file: str
    line: Optional[int]
    message: str
    fix: str = ""

    def format(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        fix = f"\n    fix: {self.fix}" if self.fix else ""
        return f"{where}: {self.severity}: [{self.model}] {self.message}{fix}"


@dataclass
class Model:
    name: str
    dir: Path
    config_path: Path
    text: str
    config: Optional[Any]  # ModelConfig, None when it does not parse

    def line_of(self, pattern: str) -> Optional[int]:
        """1-based line of the first match of a regex in config.pbtxt."""
        rx = re.compile(pattern)
        for i, line in enumerate(self.text.splitlines(), 1):
            if rx.search(line):
                return i
        return None

    def param(self, key: str) -> Optional[str]:
        if self.config is None or key not in self.config.parameters:
            return None
        return self.config.parameters[key].string_value

    def param_line(self, key: str) -> Optional[int]:
        return self.line_of(rf'key:\s*"{re.escape(key)}"')

    @property
    def decoupled(self) -> bool:
        return bool(self.config is not None and self.config.model_transaction_policy.decoupled)


def load_models(repo: Path) -> tuple[dict[str, Model], list[Finding]]:
    models: dict[str, Model] = {}
    findings: list[Finding] = []
    for d in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        cfg_path = d / "config.pbtxt"
        if not cfg_path.is_file():
            findings.append(Finding("error", d.name, str(d), None, "model directory has no config.pbtxt",
                                    "add a config.pbtxt, or move the directory out of the repository"))
            continue
        text = cfg_path.read_text(encoding="utf-8", errors="replace")
        config = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, config)
        except text_format.ParseError as exc:
            line = exc.GetLine() if hasattr(exc, "GetLine") else None
            findings.append(Finding("error", d.name, str(cfg_path), line,
                                    f"does not parse as a Triton ModelConfig: {exc}",
                                    "fix the field named (unknown fields, bad enum values and wrong types are "
                                    "rejected by tritonserver too)"))
            config = None
        models[d.name] = Model(d.name, d, cfg_path, text, config)
        if config is not None and config.name and config.name != d.name:
            findings.append(Finding("error", d.name, str(cfg_path), models[d.name].line_of(r"^\s*name\s*:"),
                                    f"config name {config.name!r} differs from its directory {d.name!r}",
                                    f'set name: "{d.name}"'))
    return models, findings


@functools.lru_cache(maxsize=1)
def upstream_parameters() -> dict[str, Any]:
    """How upstream's models read each parameter and what an unfilled one means there
    (``triton/data/upstream_parameters.yaml``, read from tensorrtllm_backend at the commit it names)."""
    import yaml

    return yaml.safe_load((resources.files("kiln.triton") / "data" / "upstream_parameters.yaml").read_text("utf-8"))


def _parameter_at(m: Model, line_no: int, placeholder: str) -> Optional[str]:
    """The parameter whose value holds ``placeholder`` on line ``line_no`` (the nearest ``key:`` above it)."""
    if m.config is None:
        return None
    lines = m.text.splitlines()
    for i in range(line_no - 1, -1, -1):
        match = re.search(r'key:\s*"([^"]+)"', lines[i])
        if match:
            key = match.group(1)
            if key in m.config.parameters and placeholder in m.config.parameters[key].string_value:
                return key
            return None
    return None


def _is_set(value: Optional[str]) -> bool:
    return bool(value) and not PLACEHOLDER.search(value or "")


def _grade(m: Model, key: str, placeholder: str, file: str, line: int) -> Finding:
    """An unfilled parameter: an error where upstream's model reads it with no fallback, else a warning naming the
    default it falls back to (the table in upstream_parameters.yaml, with the upstream file and line read)."""
    table = upstream_parameters()
    entry = (table["models"].get(m.name) or {}).get(key)
    backend = table.get("backends", {}).get(m.name)
    if entry is not None and backend is not None and m.config is not None and m.config.backend != backend:
        entry = None  # the table describes upstream's backend for this model, not another one
    where = f"tensorrtllm_backend@{table['source']['commit']} {entry['source']}" if entry else ""
    fill = f"fill {placeholder} (upstream's fill_template leaves unknown names in place)"
    if entry is None:
        return Finding("error", m.name, file, line, f"unfilled placeholder {placeholder} in parameter {key!r}: "
                       "kiln does not know how this model reads it", fill + ", or delete the parameter")
    cond = entry.get("error_when")
    if cond is not None:
        other = m.param(cond["parameter"])
        hit = (other == cond["equals"]) if "equals" in cond else (_is_set(other) == bool(cond.get("set")))
        if hit:
            return Finding("error", m.name, file, line, f"unfilled parameter {key} ({placeholder}): {entry['reason']} "
                           f"[{where}]", fill)
    elif entry.get("severity") == "error":
        return Finding("error", m.name, file, line, f"unfilled parameter {key} ({placeholder}): {entry['reason']} "
                       f"[{where}]", fill)
    return Finding("warning", m.name, file, line, f"unfilled parameter {key} ({placeholder}) means upstream's "
                   f"default: {entry['default']} [{where}]", fill + " to choose a value, or delete the parameter")


def check_placeholders(m: Model) -> Iterable[Finding]:
    """Every ``${…}`` left outside comments: graded by how upstream reads the parameter that holds it."""
    for i, line in enumerate(m.text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue  # protobuf text format comment: tritonserver never sees it
        for match in PLACEHOLDER.finditer(line):
            key = _parameter_at(m, i, match.group(0))
            if key is not None:
                yield _grade(m, key, match.group(0), str(m.config_path), i)
                continue
            yield Finding("error", m.name, str(m.config_path), i, f"unfilled placeholder {match.group(0)}",
                          "fill it with a value (upstream's fill_template leaves unknown ones in place, where "
                          "they break parsing or silently mean 'default')")


def _outside(raw: str, repo: Path) -> bool:
    """An absolute path that is neither in the repository nor under the container root kiln mounts it at: a path
    on the serving machine or in its container, which this machine need not have."""
    p = Path(raw)
    if not p.is_absolute() or raw.startswith(CONTAINER_MODEL_ROOT + "/"):
        return False
    try:
        p.resolve().relative_to(Path(repo).resolve())
        return False
    except ValueError:
        return True


def _tensors(config: Any, kind: str) -> dict[str, Any]:
    return {t.name: t for t in getattr(config, kind)}


def _dtype(t: Any) -> str:
    return model_config_pb2.DataType.Name(t.data_type)


def check_ensemble(m: Model, models: dict[str, Model]) -> Iterable[Finding]:
    if m.config is None or m.config.platform != "ensemble":
        return
    ens_in, ens_out = _tensors(m.config, "input"), _tensors(m.config, "output")
    produced: dict[str, tuple[str, str]] = {name: ("<ensemble input>", _dtype(t)) for name, t in ens_in.items()}
    file = str(m.config_path)
    for step in m.config.ensemble_scheduling.step:
        target = models.get(step.model_name)
        step_line = m.line_of(rf'model_name:\s*"{re.escape(step.model_name)}"')
        if target is None:
            yield Finding("error", m.name, file, step_line, f"ensemble step uses model {step.model_name!r}, which is "
                          "not in the repository", f"add the {step.model_name} model or fix model_name")
            continue
        if target.config is None:
            continue
        t_in, t_out = _tensors(target.config, "input"), _tensors(target.config, "output")
        for model_tensor, ens_tensor in step.input_map.items():
            line = m.line_of(rf'key:\s*"{re.escape(model_tensor)}"')
            if model_tensor not in t_in:
                yield Finding("error", m.name, file, line, f"step {step.model_name}: input_map feeds "
                              f"{model_tensor!r}, which {step.model_name} does not declare as an input",
                              f"use one of: {', '.join(sorted(t_in))}")
                continue
            source = produced.get(ens_tensor)
            if source is None:
                yield Finding("error", m.name, file, line, f"step {step.model_name}: {model_tensor} is fed from "
                              f"{ens_tensor!r}, which no ensemble input or earlier step produces",
                              "map it from an ensemble input or an earlier step's output_map")
            elif source[1] != _dtype(t_in[model_tensor]):
                yield Finding("error", m.name, file, line, f"step {step.model_name}: {model_tensor} is "
                              f"{_dtype(t_in[model_tensor])} but {ens_tensor} is {source[1]} (from {source[0]})",
                              "make the types agree")
        for model_tensor, ens_tensor in step.output_map.items():
            line = m.line_of(rf'key:\s*"{re.escape(model_tensor)}"')
            if model_tensor not in t_out:
                yield Finding("error", m.name, file, line, f"step {step.model_name}: output_map reads "
                              f"{model_tensor!r}, which {step.model_name} does not declare as an output",
                              f"use one of: {', '.join(sorted(t_out))}")
                continue
            produced[ens_tensor] = (step.model_name, _dtype(t_out[model_tensor]))
    for name, t in ens_out.items():
        line = m.line_of(rf'name:\s*"{re.escape(name)}"')
        if name not in produced:
            yield Finding("error", m.name, file, line, f"ensemble output {name!r} is produced by no step",
                          "map it in a step's output_map or remove it")
        elif produced[name][1] != _dtype(t):
            yield Finding("error", m.name, file, line, f"ensemble output {name} is {_dtype(t)} but step "
                          f"{produced[name][0]} produces {produced[name][1]}", "make the types agree")


def engine_dir_for(m: Model, repo: Path) -> Optional[Path]:
    """The engine directory `gpt_model_path` points to, mapped into this checkout when it is a container path."""
    raw = m.param("gpt_model_path") or m.param("engine_dir")
    if not raw or PLACEHOLDER.search(raw):
        return None
    p = Path(raw)
    candidates = [p]
    if raw.startswith(CONTAINER_MODEL_ROOT + "/"):
        candidates.append(repo / raw[len(CONTAINER_MODEL_ROOT) + 1:])
    if not p.is_absolute():
        candidates += [m.dir / p, repo / p]
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    return candidates[-1]


def check_engine_agreement(m: Model, repo: Path) -> Iterable[Finding]:
    """tensorrt_llm limits and KV features vs the engine's config.json (the engine's build values win at run time,
    so a disagreement means the repository does not do what it says)."""
    if m.config is None or m.name != TRTLLM_MODEL:
        return
    file = str(m.config_path)
    engine = engine_dir_for(m, repo)
    if engine is None:
        if not PLACEHOLDER.search(m.param("gpt_model_path") or m.param("engine_dir") or ""):  # else graded above
            yield Finding("error", m.name, file, m.param_line("gpt_model_path"), "gpt_model_path is not set",
                          "point gpt_model_path at the engine directory")
        return
    cfg_file = engine / "config.json"
    raw = m.param("gpt_model_path") or m.param("engine_dir") or ""
    if not cfg_file.exists() and _outside(raw, repo):
        yield Finding("warning", m.name, file, m.param_line("gpt_model_path"),
                      f"engine directory {raw} does not exist on this machine (a path on the serving host or in its "
                      "container?): the limits are not checked against the engine",
                      "lint where the engine is, or put the engine in the repository")
        return
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        yield Finding("error", m.name, file, m.param_line("gpt_model_path"),
                      f"engine config {cfg_file} is missing or unreadable ({exc.__class__.__name__})",
                      "build the engine (kiln build) or fix gpt_model_path")
        return
    bc = cfg.get("build_config", {})
    pc = bc.get("plugin_config", {})
    e_batch, e_beam = bc.get("max_batch_size"), bc.get("max_beam_width", 1)
    if e_batch is not None and m.config.max_batch_size > e_batch:
        yield Finding("error", m.name, file, m.line_of(r"^\s*max_batch_size\s*:"),
                      f"max_batch_size {m.config.max_batch_size} exceeds the engine's {e_batch}",
                      f"set max_batch_size: {e_batch} (or rebuild the engine with a larger engine.max_batch_size)")
    beam = parse_int(m.param("max_beam_width"))
    if beam is not None and e_beam is not None and beam > e_beam:
        yield Finding("error", m.name, file, m.param_line("max_beam_width"),
                      f"max_beam_width {beam} exceeds the engine's {e_beam}", f"set it to {e_beam} or rebuild")
    paged = str(bc.get("kv_cache_type", "paged")).lower().endswith("paged") and pc.get("paged_kv_cache", True) is not False
    paged_ctx = bool(pc.get("use_paged_context_fmha", False)) and pc.get("context_fmha", True) is not False
    quant = (cfg.get("pretrained_config", {}) or {}).get("quantization", {}) or {}
    kv_fmt = kv_format_for_quant_algo(quant.get("kv_cache_quant_algo"))
    no_paged_ctx = kv_fmt is not None and kv_fmt.disables_paged_context_fmha
    reuse = parse_bool(m.param("enable_kv_cache_reuse"))
    if reuse is None and m.param("enable_kv_cache_reuse") is None:
        reuse = True  # the backend's default when unset
    for key, on in (("enable_kv_cache_reuse", reuse), ("enable_chunked_context", parse_bool(m.param("enable_chunked_context")))):
        if not on:
            continue
        if not paged or not paged_ctx or no_paged_ctx:
            why = ("the engine has no paged KV cache" if not paged else
                   f"the engine's {kv_fmt.label} disables paged context FMHA" if kv_fmt and no_paged_ctx else
                   "the engine was built without paged context FMHA")
            yield Finding("error", m.name, file, m.param_line(key) or m.line_of("parameters"),
                          f"{key} is on but {why}",
                          f'set {key} to "false", or rebuild with engine.use_paged_context_fmha: true')
    logits_dtype = (cfg.get("pretrained_config", {}) or {}).get("logits_dtype") or "float32"
    want = LOGITS_TRITON_TYPE.get(logits_dtype)
    for out in m.config.output:
        if out.name in ("context_logits", "generation_logits") and want is not None:
            got = model_config_pb2.DataType.Name(out.data_type)
            if got != want:
                yield Finding("error", m.name, file, m.line_of(rf'name:\s*"{out.name}"'),
                              f"{out.name} is declared {got} but the engine's logits are {logits_dtype}: the backend "
                              "returns garbage or asserts", f"declare it {want}, or rebuild with --logits_dtype "
                              f"{'float16' if got == 'TYPE_FP16' else 'float32'}")
    gmt = m.param("gpt_model_type")
    if gmt in ("inflight_fused_batching", "inflight_batching") and not paged:
        yield Finding("error", m.name, file, m.param_line("gpt_model_type"),
                      "in-flight batching needs an engine with a paged KV cache", "rebuild with kv_cache_type paged")


def check_decoupled(models: dict[str, Model], kiln_info: dict) -> Iterable[Finding]:
    trt = models.get(TRTLLM_MODEL)
    bls = models.get("tensorrt_llm_bls")
    if trt is None or trt.config is None:
        return
    if kiln_info.get("streaming") and not trt.decoupled:
        yield Finding("error", trt.name, str(trt.config_path), trt.line_of("model_transaction_policy"),
                      "the recipe streams tokens (serving.streaming) but tensorrt_llm is not decoupled",
                      "set model_transaction_policy { decoupled: true }")
    if bls is not None and bls.config is not None and bls.decoupled != trt.decoupled:
        yield Finding("error", bls.name, str(bls.config_path), bls.line_of("model_transaction_policy"),
                      f"tensorrt_llm_bls is {'not ' if not bls.decoupled else ''}decoupled but tensorrt_llm is"
                      f"{'' if trt.decoupled else ' not'}: streaming through the BLS needs both decoupled",
                      "give both the same model_transaction_policy.decoupled")
    ens = models.get("ensemble")
    if ens is not None and ens.config is not None and "stream" in _tensors(ens.config, "input") and not trt.decoupled:
        yield Finding("warning", ens.name, str(ens.config_path), ens.line_of(r'name:\s*"stream"'),
                      "the ensemble accepts `stream` but tensorrt_llm is not decoupled: stream=true requests fail",
                      "make tensorrt_llm decoupled, or drop the stream input")


def _tokenizer_dir(m: Model, repo: Path) -> Optional[Path]:
    raw = m.param("tokenizer_dir")
    if raw is None or PLACEHOLDER.search(raw):
        return None
    p = Path(raw)
    if raw.startswith(CONTAINER_MODEL_ROOT + "/"):
        mapped = repo / raw[len(CONTAINER_MODEL_ROOT) + 1:]
        if mapped.exists():
            return mapped
    if not p.is_absolute():
        for base in (m.dir, repo):
            if (base / p).exists():
                return base / p
        return m.dir / p
    return p


def check_tokenizer(m: Model, repo: Path) -> Iterable[Finding]:
    if m.config is None or m.name not in ("preprocessing", "postprocessing"):
        return
    file = str(m.config_path)
    line = m.param_line("tokenizer_dir")
    tdir = _tokenizer_dir(m, repo)
    if tdir is None:
        if not PLACEHOLDER.search(m.param("tokenizer_dir") or ""):  # an unfilled one is graded by check_placeholders
            yield Finding("error", m.name, file, line, "tokenizer_dir is not set", "point it at the tokenizer directory")
        return
    raw = m.param("tokenizer_dir") or ""
    if not tdir.is_dir() and _outside(raw, repo):
        yield Finding("warning", m.name, file, line, f"tokenizer directory {raw} does not exist on this machine (a "
                      "path on the serving host or in its container?): the tokenizer is not checked",
                      "lint where the tokenizer is, or copy it into the repository (kiln package does)")
        return
    if not tdir.is_dir():
        yield Finding("error", m.name, file, line, f"tokenizer directory {tdir} does not exist",
                      "copy the tokenizer into the repository (kiln package does) or fix tokenizer_dir")
        return
    tj = tdir / "tokenizer.json"
    try:
        if tj.is_file():
            from tokenizers import Tokenizer

            Tokenizer.from_file(str(tj))
        else:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tdir))
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        yield Finding("error", m.name, file, line, f"tokenizer in {tdir} does not load: {exc}",
                      "ship a complete tokenizer (tokenizer.json + tokenizer_config.json)")


def check_versions(models: dict[str, Model], repo: Path, kiln_info: dict) -> Iterable[Finding]:
    trt = models.get(TRTLLM_MODEL)
    container = kiln_info.get("container")
    if trt is None or trt.config is None or not container or trt.config.backend != "tensorrtllm":
        return
    engine = engine_dir_for(trt, repo)
    try:
        version = json.loads((engine / "config.json").read_text()).get("version") if engine else None
    except (OSError, ValueError):
        return
    if not version:
        return
    ships = [v for v, tags in NGC_CONTAINERS.items() if container in tags]
    if ships and version not in ships:
        yield Finding("error", "kiln.json", str(repo / "kiln.json"), None,
                      f"the engine was built with TensorRT-LLM {version} but {container} ships {', '.join(ships)}: "
                      "loading fails with 'Serialization assertion stdVersionRead == kSERIALIZATION_VERSION'",
                      "rebuild the engine inside that container, or serve it with a container that ships "
                      f"{version}")


def lint_repository(repo: Path) -> list[Finding]:
    """Every finding for the repository at `repo` (errors first)."""
    repo = Path(repo)
    if not repo.is_dir():
        return [Finding("error", "-", str(repo), None, "not a directory", "give the model repository's path")]
    models, findings = load_models(repo)
    if not models:
        findings.append(Finding("error", "-", str(repo), None, "no models in the repository",
                                "a repository holds one directory per model, each with a config.pbtxt"))
    kiln_info: dict = {}
    if (repo / "kiln.json").is_file():
        try:
            kiln_info = json.loads((repo / "kiln.json").read_text())
        except ValueError as exc:
            findings.append(Finding("error", "kiln.json", str(repo / "kiln.json"), None, f"unreadable: {exc}"))
    from kiln.triton.lint_llmapi import check_llmapi, is_llmapi

    llmapi = is_llmapi(models)  # Triton's llmapi layout (target pytorch): model.yaml instead of an engine
    for m in models.values():
        findings += check_placeholders(m)
        findings += check_ensemble(m, models)
        if not (llmapi and m.name == TRTLLM_MODEL):
            findings += check_engine_agreement(m, repo)
        findings += check_tokenizer(m, repo)
    if llmapi:
        findings += check_llmapi(models[TRTLLM_MODEL], repo, kiln_info)
    findings += check_decoupled(models, kiln_info)
    findings += check_versions(models, repo, kiln_info)
    return sorted(findings, key=lambda f: (f.severity != "error", f.model, f.line or 0))
