"""kiln's llmapi Triton model (target pytorch) and its unified-checkpoint worker against the pinned upstream
interfaces, statically: every call into tensorrt_llm / modelopt, each keyword, and every attribute read on the
objects those calls return, checked against src/kiln/runtime/data/upstream_api.yaml (TensorRT-LLM 1.2.1's LLM API and
the ModelOpt it pins, with their sources) — the check test_runtime_workers.py makes of the workers, here following the
LLM's request outputs through the model's code.
"""

from __future__ import annotations

import ast
from importlib import resources
from pathlib import Path

import pytest
import yaml

from kiln.runtime.engine_runtime import workers_dir
from kiln.triton.repository import models_source

API = yaml.safe_load((resources.files("kiln.runtime") / "data" / "upstream_api.yaml").read_text())
MODEL = models_source() / "llmapi" / "model.py"
UPSTREAM = ("tensorrt_llm", "modelopt")


def _key(node: ast.AST) -> str | None:
    """A trackable name: `x` or `self.x`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return f"self.{node.attr}"
    return None


class Checker(ast.NodeVisitor):
    """Resolves names bound to upstream modules, callables and the objects they return (flow-insensitively, the
    first upstream binding of a name wins), and records every problem against the API data file."""

    def __init__(self, api: dict) -> None:
        self.api = api
        self.known = set(api["callables"]) | set(api["attributes"])
        self.aliases: dict[str, str] = {}  # name → dotted upstream name (modules, callables)
        self.types: dict[str, str] = {}  # name → upstream type of the object it holds
        self.problems: list[str] = []
        self.seen: list[str] = []

    # -------------------------------------------------------------- resolution
    def dotted(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute) and _key(node) not in self.aliases | self.types:
            parts.append(node.attr)
            node = node.value
        key = _key(node)
        if key in self.aliases:
            return ".".join([self.aliases[key], *reversed(parts)])
        if key in self.types:
            return ".".join([self.types[key], *reversed(parts)])
        return None

    def type_of(self, node: ast.AST) -> str | None:
        """The upstream type of an expression's value, where it has one."""
        if isinstance(node, ast.Call):
            name = self.dotted(node.func)
            return self.api["callables"].get(name, {}).get("returns") if name else None
        if isinstance(node, ast.Subscript):
            inner = self.attribute_type(node.value)
            return inner[5:-1] if inner and inner.startswith("List[") else None
        if isinstance(node, (ast.Name, ast.Attribute)):
            key = _key(node)
            if key in self.types:
                return self.types[key]
            return self.attribute_type(node)
        return None

    def attribute_type(self, node: ast.AST) -> str | None:
        if not isinstance(node, ast.Attribute):
            return None
        owner = self.type_of(node.value)
        if owner is None:
            return None
        return self.api["attributes"].get(f"{owner}.{node.attr}", {}).get("type")

    def bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v)
            return
        key = _key(target)
        if key is None or key in self.aliases or key in self.types:
            return
        kind = self.type_of(value)
        if kind:
            self.types[key] = kind
        elif isinstance(value, (ast.Name, ast.Attribute)) and self.dotted(value) in self.api["callables"]:
            self.aliases[key] = self.dotted(value)  # e.g. self.sampling_params = SamplingParams

    # -------------------------------------------------------------- visitors
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith(UPSTREAM):
                self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.startswith(UPSTREAM):
            for a in node.names:
                name = f"{node.module}.{a.name}"
                self.aliases[a.asname or a.name] = name
                if name not in self.known and not any(k.startswith(name + ".") for k in self.known):
                    self.problems.append(f"{name}: imported, not in the API data file")

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for arg in node.args.args:
            if isinstance(arg.annotation, ast.Constant) and isinstance(arg.annotation.value, str) \
                    and arg.annotation.value.startswith(UPSTREAM):
                self.types[arg.arg] = arg.annotation.value
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self.bind(target, node.value)

    def visit_AsyncFor(self, node: ast.AsyncFor) -> None:
        kind = self.type_of(node.iter)
        yields = self.api.get("types", {}).get(kind or "", {}).get("async_iterates")
        key = _key(node.target)
        if yields and key:
            self.types[key] = yields
        elif kind:
            self.problems.append(f"{kind}: `async for` over it, but the API data file says it does not iterate")
        self.generic_visit(node)

    def visit_ListComp(self, node: ast.AST) -> None:
        """The generators bind the names the element reads: visit them first."""
        for gen in node.generators:
            self.visit(gen)
        for name in ("elt", "key", "value"):
            if hasattr(node, name):
                self.visit(getattr(node, name))

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp  # type: ignore[assignment]

    def visit_comprehension(self, node: ast.comprehension) -> None:
        element = self.attribute_type(node.iter)
        key = _key(node.target)
        if key and element and element.startswith("List["):
            self.types[key] = element[5:-1]
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = self.type_of(node.value)
        if owner is not None:
            name = f"{owner}.{node.attr}"
            self.seen.append(name)
            if name not in self.known:
                self.problems.append(f"{name}: read, not in the API data file")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        if name and name not in self.api["callables"] and name.rsplit(".", 1)[0] in self.api["attributes"]:
            name = None  # a method of a plain value an upstream attribute holds (e.g. `output.text.encode`)
        if name and name.startswith(UPSTREAM):
            self.seen.append(name)
            self.problems += call_problems(self.api, name, node)
        self.generic_visit(node)


def call_problems(api: dict, name: str, call: ast.Call) -> list[str]:
    spec = api["callables"].get(name)
    if spec is None:
        return [f"{name}: called, not in the API data file"]
    params = spec["positional"] + [p for p in spec["required"] + spec["optional"] if p not in spec["positional"]]
    problems = []
    if len(call.args) > len(spec["positional"]):
        problems.append(f"{name}: {len(call.args)} positional arguments, upstream takes {len(spec['positional'])}")
    given = set(spec["positional"][:len(call.args)])
    for kw in call.keywords:
        if kw.arg is None:
            if not spec.get("kwargs_from"):
                problems.append(f"{name}: **kwargs hides its keywords from the check")
        elif kw.arg not in params and not spec.get("var_keyword"):
            problems.append(f"{name}: unknown keyword {kw.arg!r}")
        else:
            given.add(kw.arg)
    if not any(kw.arg is None for kw in call.keywords):
        problems += [f"{name}: missing required {p!r}" for p in spec["required"] if p not in given]
    return problems


def check(path_or_source, api: dict = API) -> Checker:
    source = path_or_source.read_text(encoding="utf-8") if isinstance(path_or_source, Path) else path_or_source
    checker = Checker(api)
    checker.visit(ast.parse(source))
    return checker


def _literal(name: str) -> object:
    """A module-level table of model.py, its Python types (int, float, …) as their names."""
    tree = ast.parse(MODEL.read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == name for t in n.targets))
    text = ast.unparse(node.value)
    return eval(text, {"__builtins__": {}}, {"int": "int", "float": "float", "bool": "bool"})  # noqa: S307


# --------------------------------------------------------------------------------------------------- tests


def test_every_llm_api_call_and_attribute_of_the_model_is_the_pinned_one() -> None:
    checker = check(MODEL)
    assert checker.problems == []
    # the check followed the objects: the engine, its request outputs, their completions and perf metrics
    assert {"tensorrt_llm.LLM", "tensorrt_llm.LLM.generate_async", "tensorrt_llm.LLM.shutdown",
            "tensorrt_llm.SamplingParams", "tensorrt_llm.llmapi.llm_utils.update_llm_args_with_extra_dict",
            "tensorrt_llm.llmapi.RequestOutput.abort", "tensorrt_llm.llmapi.RequestOutput.finished",
            "tensorrt_llm.llmapi.RequestOutput.outputs", "tensorrt_llm.llmapi.CompletionOutput.text",
            "tensorrt_llm.llmapi.CompletionOutput.request_perf_metrics",
            "tensorrt_llm.bindings.executor.KvCacheMetrics.num_reused_blocks",
            "tensorrt_llm.bindings.executor.TimingMetrics.arrival_time"} <= set(checker.seen)


def test_the_sampling_keywords_and_output_switches_are_upstreams() -> None:
    """SamplingParams is called with **kwargs built from SAMPLING_INPUTS and STOP_INPUT: each keyword must be one
    the pinned SamplingParams takes, each input one the llmapi contract declares."""
    from kiln.triton.llmapi import llmapi_model_data

    spec = API["callables"]["tensorrt_llm.SamplingParams"]
    inputs = {t["name"] for t in llmapi_model_data()["inputs"]}
    table = _literal("SAMPLING_INPUTS")
    stop = _literal("STOP_INPUT")
    keywords = [kw for kw, _ in table.values()] + [stop[1]]
    assert set(keywords) <= set(spec["optional"])
    assert set(table) | {stop[0]} <= inputs
    assert {f"sampling_param_{k}" for k in llmapi_model_data()["sampling_params"]} == set(table)
    for attr in _literal("OUTPUT_SWITCHES").values():
        assert f"tensorrt_llm.llmapi.CompletionOutput.{attr}" in API["attributes"]


@pytest.mark.parametrize("edit, problem", [
    ("sampling_params=params, streaming=streaming", "tensorrt_llm.LLM.generate_async: unknown keyword 'stream'"),
    ("output.finished", "tensorrt_llm.llmapi.RequestOutput.done: read, not in the API data file"),
    ("self._llm.shutdown()", "tensorrt_llm.LLM.stop: called, not in the API data file"),
    ("first.request_perf_metrics", "tensorrt_llm.llmapi.CompletionOutput.perf_metrics: read, not in the API data"),
    ("update_llm_args_with_extra_dict({}, llm_args)", "update_llm_args_with_extra_dict: missing required "
                                                       "'llm_args_dict'"),
])
def test_the_checker_catches_a_wrong_call_keyword_or_attribute(edit: str, problem: str) -> None:
    wrong = {"sampling_params=params, streaming=streaming": "sampling_params=params, stream=streaming",
             "output.finished": "output.done", "self._llm.shutdown()": "self._llm.stop()",
             "first.request_perf_metrics": "first.perf_metrics",
             "update_llm_args_with_extra_dict({}, llm_args)": "update_llm_args_with_extra_dict({})"}[edit]
    source = MODEL.read_text(encoding="utf-8")
    assert edit in source
    problems = check(source.replace(edit, wrong)).problems
    assert any(problem in p for p in problems), problems


def test_streaming_is_passed_by_keyword() -> None:
    """generate_async's third positional parameter is lora_request (upstream's 1.2.0rc2 model passes streaming
    there): a positional streaming argument would be taken for a LoRA request."""
    source = MODEL.read_text(encoding="utf-8").replace("generate_async(prompt, sampling_params=params, "
                                                       "streaming=streaming)",
                                                       "generate_async(prompt, params, streaming)")
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "generate_async"]
    spec = API["callables"]["tensorrt_llm.LLM.generate_async"]
    assert spec["positional"][2] == "lora_request" and len(calls[0].args) == 3  # what the check must not allow
    tree = ast.parse(MODEL.read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "generate_async")
    assert len(call.args) == 1 and {k.arg for k in call.keywords} == {"sampling_params", "streaming"}


def test_the_unified_checkpoint_worker_calls_what_matters() -> None:
    checker = check(workers_dir() / "export_hf.py")
    assert checker.problems == []
    assert {"modelopt.torch.export.export_hf_checkpoint",
            "modelopt.torch.export.unified_export_hf.requantize_resmooth_fused_llm_layers"} <= set(checker.seen)
    source = (workers_dir() / "export_hf.py").read_text().replace("export_dir=job[", "output_dir=job[")
    assert "modelopt.torch.export.export_hf_checkpoint: unknown keyword 'output_dir'" in check(source).problems


def test_the_models_import_nothing_of_kiln_but_their_shipped_helpers() -> None:
    for path in (MODEL, models_source() / "llmapi" / "kiln_llmapi_reference.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m == "kiln" or m.startswith("kiln.")}, path
        assert not {m for m in imported if m.startswith(("modelopt", "tensorrt"))} or path == MODEL
