"""kiln's engine-runtime workers against the pinned upstream interfaces, statically.

Every call a worker makes into tensorrt_llm or modelopt — the function, its positional arguments and each keyword —
is checked against src/kiln/runtime/data/upstream_api.yaml (the interfaces of TensorRT-LLM 1.2.1 and the ModelOpt it
pins, with their sources). The workers import nothing of kiln, and nothing in kiln imports the quantize worker.
"""

from __future__ import annotations

import ast
import inspect
from importlib import resources
from pathlib import Path

import pytest
import yaml

from kiln.runtime.engine_runtime import workers_dir

API = yaml.safe_load((resources.files("kiln.runtime") / "data" / "upstream_api.yaml").read_text())
WORKERS = sorted(workers_dir().glob("*.py"))
UPSTREAM = ("tensorrt_llm", "modelopt")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to upstream modules or objects: `import modelopt.torch.quantization as mtq` → mtq →
    modelopt.torch.quantization; `from tensorrt_llm.quantization import quantize_and_export` → that name."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(UPSTREAM):
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(UPSTREAM):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def upstream_uses(path: Path) -> tuple[list[tuple[str, ast.Call]], list[str]]:
    """(calls into upstream, upstream attributes read or assigned) of one worker."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = _aliases(tree)
    calls, attributes = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func, aliases)
            if name:
                calls.append((name, node))
        elif isinstance(node, ast.Attribute):
            name = _dotted(node, aliases)
            if name:
                attributes.append(name)
    imported = [v for v in aliases.values() if "." in v and v.rsplit(".", 1)[1][:1].isalpha()]
    return calls, attributes + imported


def _problems(name: str, call: ast.Call) -> list[str]:
    spec = API["callables"].get(name)
    if spec is None:
        return [f"{name}: not in the API data file"]
    params = spec["positional"] + [p for p in spec["required"] + spec["optional"] if p not in spec["positional"]]
    problems = []
    if len(call.args) > len(spec["positional"]):
        problems.append(f"{name}: {len(call.args)} positional arguments, upstream takes {len(spec['positional'])}")
    given = set(spec["positional"][:len(call.args)])
    for kw in call.keywords:
        if kw.arg is None:
            problems.append(f"{name}: **kwargs hides its keywords from the check")
        elif kw.arg not in params and not spec.get("var_keyword"):
            problems.append(f"{name}: unknown keyword {kw.arg!r}")
        else:
            given.add(kw.arg)
    problems += [f"{name}: missing required {p!r}" for p in spec["required"] if p not in given]
    return problems


@pytest.mark.parametrize("worker", WORKERS, ids=lambda p: p.name)
def test_every_upstream_call_matches_the_pinned_interface(worker: Path) -> None:
    calls, attributes = upstream_uses(worker)
    problems = [p for name, call in calls for p in _problems(name, call)]
    known = set(API["callables"]) | set(API["attributes"])
    modules = {n.rsplit(".", 1)[0] for n in known}
    problems += [f"{a}: not in the API data file" for a in attributes if a not in known and a not in modules]
    assert problems == []


def test_the_checker_catches_a_wrong_keyword(tmp_path: Path) -> None:
    source = (workers_dir() / "quantize.py").read_text().replace("calib_size=job[", "calib_samples=job[")
    (tmp_path / "bad.py").write_text(source)
    calls, _ = upstream_uses(tmp_path / "bad.py")
    problems = [p for name, call in calls for p in _problems(name, call)]
    assert "tensorrt_llm.quantization.quantize_and_export: unknown keyword 'calib_samples'" in problems
    assert "tensorrt_llm.quantization.quantize_and_export: missing required 'calib_size'" in problems


def test_the_workers_call_what_matters() -> None:
    calls, attributes = upstream_uses(workers_dir() / "quantize.py")
    assert {n for n, _ in calls} >= {"tensorrt_llm.quantization.quantize_and_export"}
    assert "modelopt.torch.quantization.quantize" in attributes  # wrapped, so the calibrated state is saved
    calls, _ = upstream_uses(workers_dir() / "worker_io.py")  # the state every worker saves and restores
    assert {n for n, _ in calls} >= {"modelopt.torch.opt.modelopt_state",
                                     "modelopt.torch.opt.restore_from_modelopt_state"}
    # mto.save writes model.state_dict() (ModelOpt 0.37 and 0.47): a second full copy of the weights (issue 20)
    everywhere = {n for w in WORKERS for n, _ in upstream_uses(w)[0]}
    assert not everywhere & {"modelopt.torch.opt.save", "modelopt.torch.opt.restore"}


def test_the_standin_quantizer_has_upstreams_exact_signature() -> None:
    """The test stand-in of quantize_and_export (tests/standin_runtime) must not be laxer than upstream."""
    import importlib.util

    path = REPO_ROOT / "tests" / "standin_runtime" / "image" / "site" / "tensorrt_llm" / "quantization" \
        / "quantize_by_modelopt.py"
    spec = importlib.util.spec_from_file_location("standin_quantize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    params = inspect.signature(module.quantize_and_export).parameters
    api = API["callables"]["tensorrt_llm.quantization.quantize_and_export"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert [n for n, p in params.items() if p.default is inspect.Parameter.empty] == api["required"]
    assert [n for n, p in params.items() if p.default is not inspect.Parameter.empty] == api["optional"]


def _imported(path: Path) -> set[str]:
    """Every module a file imports (`import a.b` → a.b; `from a.b import c` → a.b and a.b.c)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("worker", WORKERS, ids=lambda p: p.name)
def test_workers_import_nothing_of_kiln(worker: Path) -> None:
    assert not {m for m in _imported(worker) if m == "kiln" or m.startswith("kiln.")}


def test_nothing_in_kiln_imports_the_quantize_worker() -> None:
    src = REPO_ROOT / "src" / "kiln"
    offenders = [p for p in src.rglob("*.py") if "runtime.workers.quantize" in p.read_text(encoding="utf-8")
                 or "workers import quantize" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_the_workers_kiln_imports_import_no_tensorrt_llm() -> None:
    """The workers are scripts, not modules of kiln, so the import-linter contract does not see them. kiln imports
    three of them for the code it shares with the runtime; those must not bring TensorRT-LLM into kiln."""
    prefix = "kiln.runtime.workers."
    shared = {m[len(prefix):].split(".")[0] for p in (REPO_ROOT / "src" / "kiln").rglob("*.py")
              for m in _imported(p) if m.startswith(prefix)}
    assert shared == {"evaluate", "check_engine", "worker_io"}  # worker_io: kiln doctor restores the runtime's state
    for name in shared:
        assert not {m for m in _imported(workers_dir() / f"{name}.py") if m.startswith(("tensorrt_llm", "tensorrt"))}
