"""Values, not only keys: every serving value of a recipe reaches each file that carries it.

Table-driven over the schema's ``serving`` keys (``ServingSection``): each row gives a value different from the
shipped recipe's and, per repository layout, the files that carry the key with how each file spells it, or why
the layout carries none. The test packages the shipped GPU recipe llama-3.1-8b/fp8 twice per layout (as shipped,
and with every row's value changed) with kiln's own writers (repository, deploy files, trtllm-serve files), reads
each file back with a parser (protobuf text format, JSON, YAML, the shell command line) and asserts the file says
the recipe's value in both builds, so a file that hard-codes a value (or ignores the recipe) fails.

Layouts: ``ensemble`` (target tensorrt: five Triton models, kiln.json, deploy/<recipe>/), ``llmapi`` (target
pytorch with serving.llmapi_runtime tensorrt_llm: tensorrt_llm/config.pbtxt, model.yaml, kiln.json, deploy files,
deploy/<recipe>/trtllm-serve/ and deploy/<recipe>/dynamo/) and ``reference`` (the default recipe tiny-llama, target
reference: the same five models with kiln's CPU runtime as tensorrt_llm, kiln.json; no deploy files).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kiln.recipe.catalog import configs_dir
from kiln.recipe.loader import load_recipe
from kiln.recipe.schema import ServingSection
from kiln.triton.llmapi import RECIPE_MAPPING
from kiln.triton.repository import write_repository
from tests.test_repository import make_inputs, tokenizer_dir  # noqa: F401 - shared fixture

RECIPE = configs_dir() / "llama-3.1-8b" / "fp8.yaml"
LAYOUTS = {"ensemble": [], "llmapi": ["target=pytorch", "serving.llmapi_runtime=tensorrt_llm"], "reference": []}
RECIPES = {"ensemble": RECIPE, "llmapi": RECIPE, "reference": configs_dir() / "tiny-llama.yaml"}  # the CPU one


# ------------------------------------------------------------------------------------------------ reading files
@dataclass
class Files:
    """One packaged repository and its deploy files, parsed."""

    repo: Path
    deploy: Path
    configs: dict[str, Any] = field(default_factory=dict)

    def cfg(self, model: str) -> Any:
        if model not in self.configs:
            c = model_config_pb2.ModelConfig()
            text_format.Parse((self.repo / model / "config.pbtxt").read_text(), c)
            self.configs[model] = c
        return self.configs[model]

    def param(self, model: str, key: str) -> Optional[str]:
        c = self.cfg(model)
        return c.parameters[key].string_value if key in c.parameters else None

    def kiln(self) -> dict:
        return json.loads((self.repo / "kiln.json").read_text())

    def yaml(self, rel: str, root: str = "repo") -> Any:
        key = f"{root}:{rel}"
        if key not in self.configs:  # parsed once per build
            base = self.repo if root == "repo" else self.deploy
            self.configs[key] = list(yaml.safe_load_all((base / rel).read_text()))
        docs = self.configs[key]
        return docs[0] if len(docs) == 1 else docs

    def compose(self) -> dict:
        return self.yaml("docker-compose.yml", "deploy")["services"]

    def k8s(self, kind: str) -> dict:
        file = {"Deployment": "k8s/deployment.yaml", "Service": "k8s/service.yaml"}[kind]
        docs = self.yaml(file, "deploy")
        return next(d for d in (docs if isinstance(docs, list) else [docs]) if d and d["kind"] == kind)

    def container(self, name: str) -> dict:
        return next(c for c in self.k8s("Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == name)

    def argv(self, name: str) -> list[str]:
        """A pod container's command line (command + args)."""
        c = self.container(name)
        return [*c.get("command", []), *c.get("args", [])]

    def exec_words(self, rel: str) -> list[str]:
        """The words of the script's ``exec`` line (the command it runs)."""
        line = next(ln for ln in (self.deploy / rel).read_text().splitlines() if ln.startswith("exec "))
        return shlex.split(line)


def flag(words: list[str], name: str) -> Optional[str]:
    """``--name=value`` or ``--name value`` in an argv."""
    for i, w in enumerate(words):
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
        if w == name and i + 1 < len(words):
            return words[i + 1]
    return None


def dig(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def sbool(v: Optional[bool]) -> Optional[str]:
    return None if v is None else ("true" if v else "false")


# ------------------------------------------------------------------------------------------------ the table
Reader = Callable[[Files], Any]
Expect = Callable[[Any], Any]
same: Expect = lambda v: v  # noqa: E731
text: Expect = lambda v: None if v is None else str(v)  # noqa: E731


PULL_ONLY = ("only in deploy files rendered with cache.remote (the init step that pulls the repository): "
             "tests/test_deploy_cache.py")


@dataclass
class Row:
    value: Any  # the changed value (differs from the shipped recipe's)
    carried: dict[str, dict[str, tuple[Reader, Expect]]]  # layout -> {file: (read the file, expected from the value)}
    not_carried: dict[str, str] = field(default_factory=dict)  # layout -> why no file of it carries the key
    alone: Optional[dict[str, Any]] = None  # packaged on its own, with these other keys (it would hide others' values)


def pbtxt(model: str, key: str, expect: Expect = text) -> tuple[Reader, Expect]:
    return (lambda f: f.param(model, key)), expect


def ports(key: str, cli: str, port_name: str) -> Row:
    """A Triton port: the serving record, the server command, launch.sh, Compose and Kubernetes."""
    files = {
        "kiln.json serving": ((lambda f: f.kiln()["serving"][key]), same),
        "kiln.json server_command": ((lambda f: flag(f.kiln()["server_command"], cli)), text),
        "launch.sh": ((lambda f: flag(f.exec_words("launch.sh"), cli)), text),
        "docker-compose.yml command": ((lambda f: flag(f.compose()["triton"]["command"], cli)), text),
        "docker-compose.yml ports": ((lambda f: [p for p in f.compose()["triton"]["ports"]
                                                 if p.endswith(":" + flag(f.compose()["triton"]["command"], cli))]),
                                     lambda v: [f"{v}:{v}"]),
        "k8s deployment containerPort": ((lambda f: next(p["containerPort"] for p in f.container("triton")["ports"]
                                                         if p["name"] == port_name)), same),
        "k8s deployment command": ((lambda f: flag(f.argv("triton"), cli)), text),
        "k8s service port": ((lambda f: next(p["port"] for p in f.k8s("Service")["spec"]["ports"]
                                             if p["name"] == port_name)), same),
    }
    llmapi = dict(files)
    if key == "http_port":  # trtllm-serve's and Dynamo's frontend's OpenAI endpoints listen on the HTTP port
        llmapi["trtllm-serve/serve.sh"] = ((lambda f: flag(f.exec_words("trtllm-serve/serve.sh"), "--port")), text)
        llmapi["dynamo/k8s frontend"] = ((lambda f: flag(next(
            c for d in f.yaml("dynamo/k8s/graph-aggregated.yaml", "deploy") if d["kind"] == "DynamoGraphDeployment"
            for c in d["spec"]["components"] if c["name"] == "Frontend")["podTemplate"]["spec"]["containers"][0]
            ["command"], "--http-port")), text)
    local = {k: v for k, v in files.items() if k.startswith("kiln.json")}  # kiln serve's command; no deploy files
    return Row({"http_port": 18100, "grpc_port": 18101, "metrics_port": 18102}[key],
               {"ensemble": files, "llmapi": llmapi, "reference": local})


def llm_arg(*path: str, expect: Expect = same) -> dict[str, tuple[Reader, Expect]]:
    """An LLM argument: in model.yaml, trtllm-serve's --extra_llm_api_options file and Dynamo's LLM options."""
    return {"model.yaml": ((lambda f: dig(f.yaml("tensorrt_llm/1/model.yaml"), *path)), expect),
            **{rel: ((lambda f, rel=rel: dig(f.yaml(rel, "deploy"), *path)), expect)
               for rel in ("trtllm-serve/llm_options.yaml", "dynamo/llm_options.yaml")}}


def dynamo_workers(graph: str, component: str) -> dict[str, tuple[Reader, Expect]]:
    """Replicas of a worker component of a Dynamo DynamoGraphDeployment."""
    def read(f: Files) -> Any:
        doc = next(d for d in f.yaml(f"dynamo/k8s/{graph}", "deploy") if d["kind"] == "DynamoGraphDeployment")
        return next(c["replicas"] for c in doc["spec"]["components"] if c["name"] == component)
    return {f"dynamo/k8s/{graph}": (read, same)}


def pytorch(key: str) -> str:
    """Why the llmapi layout carries no file for ``key``: kiln's migration table (kiln validate --set target=pytorch)."""
    kind, why = RECIPE_MAPPING[f"serving.{key}"]
    return f"{kind}: {' '.join(why.split())}"


ROWS: dict[str, Row] = {
    "batching": Row("v1", {"ensemble": {"tensorrt_llm/config.pbtxt": pbtxt(
        "tensorrt_llm", "gpt_model_type", lambda v: {"v1": "V1", "inflight_fused": "inflight_fused_batching"}[v])}},
        {"llmapi": pytorch("batching")}),
    "scheduler_policy": Row("max_utilization", {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "batch_scheduler_policy")},
        "llmapi": llm_arg("scheduler_config", "capacity_scheduler_policy", expect=str.upper)}),
    "kv_cache_free_gpu_mem_fraction": Row(0.37, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "kv_cache_free_gpu_mem_fraction")},
        "llmapi": llm_arg("kv_cache_config", "free_gpu_memory_fraction")}),
    "max_tokens_in_paged_kv_cache": Row(7777, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "max_tokens_in_paged_kv_cache")},
        "llmapi": llm_arg("kv_cache_config", "max_tokens")}),
    "enable_kv_cache_reuse": Row(False, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "enable_kv_cache_reuse", sbool)},
        "llmapi": llm_arg("kv_cache_config", "enable_block_reuse")}),
    "enable_chunked_context": Row(False, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "enable_chunked_context", sbool)},
        "llmapi": llm_arg("enable_chunked_prefill")}),
    "kv_cache_host_memory_bytes": Row(5555, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "kv_cache_host_memory_bytes")},
        "llmapi": llm_arg("kv_cache_config", "host_cache_size", expect=lambda v: v or None)}),
    "streaming": Row(False, {
        "ensemble": {"tensorrt_llm/config.pbtxt": ((lambda f: f.cfg("tensorrt_llm").model_transaction_policy.decoupled),
                                                   same),
                     "tensorrt_llm_bls/config.pbtxt": ((lambda f: f.cfg("tensorrt_llm_bls")
                                                        .model_transaction_policy.decoupled), same),
                     "kiln.json": ((lambda f: f.kiln()["streaming"]), same)},
        "llmapi": {"tensorrt_llm/config.pbtxt": ((lambda f: f.cfg("tensorrt_llm").model_transaction_policy.decoupled),
                                                 same),
                   "model.yaml triton_config": ((lambda f: f.yaml("tensorrt_llm/1/model.yaml")["triton_config"]
                                                 ["decoupled"]), same),
                   "kiln.json": ((lambda f: f.kiln()["streaming"]), same)}}),
    "exclude_input_in_output": Row(False, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "exclude_input_in_output", sbool)},
        "llmapi": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "exclude_input_from_output", sbool)}}),
    "max_queue_delay_microseconds": Row(1234, {"ensemble": {"tensorrt_llm/config.pbtxt": (
        (lambda f: f.cfg("tensorrt_llm").dynamic_batching.max_queue_delay_microseconds), same)}},
        {"llmapi": pytorch("max_queue_delay_microseconds")}),
    "gpu_device_ids": Row((1,), {"ensemble": {"tensorrt_llm/config.pbtxt": pbtxt(
        "tensorrt_llm", "gpu_device_ids", lambda v: None if v is None else ",".join(map(str, v)))}},
        {"llmapi": pytorch("gpu_device_ids")}, alone={"hardware.count": 2}),
    **{f"{m}_instances": Row(3, {"ensemble": {f"{model}/config.pbtxt": (
        (lambda f, model=model: f.cfg(model).instance_group[0].count), same)}}, {"llmapi": pytorch(f"{m}_instances")})
       for m, model in (("preprocessing", "preprocessing"), ("postprocessing", "postprocessing"),
                        ("bls", "tensorrt_llm_bls"))},
    "add_special_tokens": Row(False, {"ensemble": {"preprocessing/config.pbtxt": pbtxt(
        "preprocessing", "add_special_tokens", sbool)}}, {"llmapi": pytorch("add_special_tokens")}),
    "skip_special_tokens": Row(False, {"ensemble": {"postprocessing/config.pbtxt": pbtxt(
        "postprocessing", "skip_special_tokens", sbool)}}, {"llmapi": pytorch("skip_special_tokens")}),
    "cuda_graphs": Row(False, {
        "ensemble": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "cuda_graph_mode", sbool)},
        "llmapi": llm_arg("cuda_graph_config", expect=lambda v: None if v is None else ({} if v else None))}),
    "llmapi_runtime": Row("reference", {"llmapi": {
        "tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "runtime"),
        "kiln.json": ((lambda f: f.kiln()["llmapi_runtime"]), same)}},
        {"ensemble": "target pytorch only: it picks what serves the llmapi model"}, alone={}),
    "cpu_threads": Row(3, {"llmapi": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "num_threads")}},
                       {"ensemble": "the CPU reference runtimes only; target tensorrt serves on GPUs"},
                       alone={"serving.llmapi_runtime": "reference"}),
    "host": Row("10.1.2.3", {layout: {"kiln.json serving": ((lambda f: f.kiln()["serving"]["host"]), same)}
                             for layout in LAYOUTS}),
    "http_port": ports("http_port", "--http-port", "http"),
    "grpc_port": ports("grpc_port", "--grpc-port", "grpc"),
    "metrics_port": ports("metrics_port", "--metrics-port", "metrics"),
    "multinode_image": Row("registry.example/multinode:1", {}, {
        layout: "multi-node deploy files only (tp × pp above hardware.gpus_per_node); the recipe is single-node"
        for layout in LAYOUTS}),
    "openai_port": Row(18103, {
        "ensemble": {"kiln.json serving": ((lambda f: f.kiln()["serving"]["openai_port"]), same),
                     "docker-compose.yml openai": ((lambda f: flag(f.compose()["openai"]["command"], "--port")), text),
                     "k8s deployment openai": ((lambda f: f.container("openai")["ports"][0]["containerPort"]), same),
                     "Dockerfile.openai": ((lambda f: re.findall(r"^EXPOSE (\d+)$", (f.deploy / "Dockerfile.openai")
                                                                 .read_text(), re.M)), lambda v: [str(v)])},
        "llmapi": {"kiln.json serving": ((lambda f: f.kiln()["serving"]["openai_port"]), same)}}),
    "openai_model": Row("tensorrt_llm_bls", {
        "ensemble": {"kiln.json serving": ((lambda f: f.kiln()["serving"]["openai_model"]), same),
                     "docker-compose.yml openai": ((lambda f: flag(f.compose()["openai"]["command"],
                                                                   "--triton-model")), same),
                     "k8s deployment openai": ((lambda f: flag(f.argv("openai"), "--triton-model")),
                                               same)},
        "llmapi": {"kiln.json serving": ((lambda f: f.kiln()["serving"]["openai_model"]), same)}}),
    "openai_sidecar": Row(False, {"ensemble": {
        "docker-compose.yml": ((lambda f: "openai" in f.compose()), same),
        "k8s deployment": ((lambda f: any(c["name"] == "openai" for c in f.k8s("Deployment")["spec"]["template"]
                                          ["spec"]["containers"])), same)}},
        {"llmapi": pytorch("openai_sidecar")}, alone={}),
    "dynamo_workers": Row(3, {"llmapi": dynamo_workers("graph-aggregated.yaml", "TRTLLMWorker")},
                          {"ensemble": "Dynamo deploy files are target pytorch's"}),
    "dynamo_prefill_workers": Row(2, {"llmapi": dynamo_workers("graph-disaggregated.yaml", "prefill")},
                                  {"ensemble": "Dynamo deploy files are target pytorch's"}),
    "dynamo_decode_workers": Row(4, {"llmapi": dynamo_workers("graph-disaggregated.yaml", "decode")},
                                 {"ensemble": "Dynamo deploy files are target pytorch's"}),
    "openai_image": Row("registry.example/kiln-openai:1", {"ensemble": {
        "docker-compose.yml openai": ((lambda f: f.compose()["openai"]["image"]), lambda v: v or IMAGE_DEFAULT),
        "k8s deployment openai": ((lambda f: f.container("openai")["image"]), lambda v: v or IMAGE_DEFAULT)}},
        {"llmapi": pytorch("openai_image")}),
    # the init step exists only in deploy files rendered with a remote cache: tests/test_deploy_cache.py reads them
    **{key: Row(value, {}, {"ensemble": PULL_ONLY, "llmapi": PULL_ONLY}) for key, value in (
        ("init_image", "registry.example/kiln-init@sha256:" + "0" * 64), ("registry_secret", "team-registry"),
        ("repo_cache_pvc", "kiln-repos"))},
}


NO_SWITCH = "kiln's CPU runtime has no such setting: the parameter is the tensorrtllm backend's (GPU)"
NO_DEPLOY = "package writes no deploy files for the CPU reference target (kiln serve runs it here)"
#: The reference layout: what kiln's CPU runtime and its repository carry (readers as for the ensemble), or why not.
REFERENCE: dict[str, Any] = {
    "batching": NO_SWITCH, "scheduler_policy": NO_SWITCH, "kv_cache_free_gpu_mem_fraction": NO_SWITCH,
    "kv_cache_host_memory_bytes": NO_SWITCH, "enable_chunked_context": NO_SWITCH,
    "gpu_device_ids": "the CPU runtime uses no GPU", "cuda_graphs": "the CPU runtime has no CUDA graphs (kiln validate "
    "warns)", "llmapi_runtime": "target pytorch only: it picks what serves the llmapi model",
    "multinode_image": NO_DEPLOY, "openai_sidecar": NO_DEPLOY, "openai_image": NO_DEPLOY,
    "dynamo_workers": NO_DEPLOY, "dynamo_prefill_workers": NO_DEPLOY, "dynamo_decode_workers": NO_DEPLOY,
    "init_image": NO_DEPLOY, "registry_secret": NO_DEPLOY, "repo_cache_pvc": NO_DEPLOY,
    "max_tokens_in_paged_kv_cache": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "max_tokens_in_paged_kv_cache")},
    "cpu_threads": {"tensorrt_llm/config.pbtxt": pbtxt("tensorrt_llm", "num_threads")},
    "openai_port": {"kiln.json serving": ROWS["openai_port"].carried["llmapi"]["kiln.json serving"]},
    "openai_model": {"kiln.json serving": ROWS["openai_model"].carried["llmapi"]["kiln.json serving"]},
    **{key: ROWS[key].carried["ensemble"] for key in (
        "enable_kv_cache_reuse", "streaming", "exclude_input_in_output", "max_queue_delay_microseconds",
        "preprocessing_instances", "postprocessing_instances", "bls_instances", "add_special_tokens",
        "skip_special_tokens")},
}
for _key, _entry in REFERENCE.items():
    if isinstance(_entry, str):
        ROWS[_key].not_carried["reference"] = _entry
    else:
        ROWS[_key].carried["reference"] = _entry


def _default_openai_image() -> str:
    from kiln.triton.deploy.openai_sidecar import default_image

    return default_image()


IMAGE_DEFAULT = _default_openai_image()


# ------------------------------------------------------------------------------------------------ packaging
def _set(key: str, value: Any) -> str:
    if isinstance(value, tuple):
        return f"serving.{key}=[{','.join(map(str, value))}]"
    if isinstance(value, bool):
        return f"serving.{key}={'true' if value else 'false'}"
    return f"serving.{key}={value}"


def package(layout: str, overrides: list[str], tmp: Path, tokenizer: Path) -> tuple[Any, Files]:
    from kiln.triton.deploy import DeployInfo, write_deploy_files
    from kiln.triton.llmapi_repository import write_llmapi_repository, write_trtllm_serve_files

    recipe = load_recipe(RECIPES[layout], LAYOUTS[layout] + overrides).recipe
    deploy = tmp / "deploy"
    deploy.mkdir(parents=True)
    repo = tmp / "repo" / recipe.name
    repo.mkdir(parents=True)
    if layout != "llmapi":
        info = write_repository(make_inputs(recipe, tmp / "inputs", tokenizer, "1.2.1"), repo, 4096)
    else:
        ckpt = tmp / "checkpoint"
        ckpt.mkdir()
        (ckpt / "config.json").write_text("{}")
        info = write_llmapi_repository(recipe, ckpt, repo, 4096)
    if info["container"]:  # the GPU's deploy files (package writes none for the CPU runtimes)
        write_deploy_files(DeployInfo.from_recipe(recipe, info["container"]), deploy, model_repo=repo)
        if layout == "llmapi":
            from kiln.triton.deploy.dynamo import DynamoDeploy, dynamo_image, write_dynamo_files

            write_trtllm_serve_files(recipe, info, deploy)
            write_dynamo_files(DynamoDeploy.from_recipe(recipe, dynamo_image(recipe)), info["llm_args"], deploy)
    return recipe, Files(repo, deploy)


@pytest.fixture(scope="module")
def packaged(tmp_path_factory, tokenizer_dir):  # noqa: F811
    """Per layout: the shipped recipe, every shared row changed at once, and each row that must be alone."""
    out: dict[tuple[str, str], tuple[Any, Files]] = {}
    for layout in LAYOUTS:
        base = tmp_path_factory.mktemp(f"{layout}-base")
        out[layout, "base"] = package(layout, [], base, tokenizer_dir)
        shared = [_set(k, r.value) for k, r in ROWS.items() if layout in r.carried and r.alone is None]
        out[layout, "changed"] = package(layout, shared, tmp_path_factory.mktemp(f"{layout}-changed"), tokenizer_dir)
        for key, row in ROWS.items():
            if layout in row.carried and row.alone is not None:
                extra = [f"{k}={v}" for k, v in row.alone.items()  # serving.llmapi_runtime is target pytorch's
                         if layout == "llmapi" or k != "serving.llmapi_runtime"]
                out[layout, key] = package(layout, extra + [_set(key, row.value)],
                                           tmp_path_factory.mktemp(f"{layout}-{key}"), tokenizer_dir)
    return out


CASES = [(key, layout, name) for key, row in ROWS.items() for layout, files in row.carried.items() for name in files]


@pytest.mark.parametrize("key,layout,name", CASES, ids=[f"{k}-{la}-{n}" for k, la, n in CASES])
def test_the_recipes_value_is_in_the_file(packaged, key, layout, name):
    row = ROWS[key]
    read, expect = row.carried[layout][name]
    base_recipe, base = packaged[layout, "base"]
    recipe, changed = packaged[layout, key if row.alone is not None else "changed"]
    before, after = getattr(base_recipe.serving, key), getattr(recipe.serving, key)
    assert after == row.value and after != before, f"serving.{key}: the changed build must change it"
    assert read(base) == expect(before), f"{name}: serving.{key}={before!r} (the shipped recipe's)"
    assert read(changed) == expect(after), f"{name}: serving.{key}={after!r} (changed)"


def test_every_serving_key_is_carried_or_says_why_not():
    assert set(ROWS) == set(ServingSection.model_fields), "a serving key without a row: say where its value goes"
    for key, row in ROWS.items():
        for layout in LAYOUTS:
            carried, why = layout in row.carried, row.not_carried.get(layout)
            assert carried != bool(why), f"serving.{key} in {layout}: carried by files, or a reason, exactly one"
