"""TensorRT-LLM after 1.2.1 and NVIDIA Dynamo, without a GPU: the 1.3/1.4 rows of the container table (which image the
jobs use, which the Dynamo files use), per-version LLM-argument tables, target tensorrt refused past 1.2.1, the
dry-run's export job in the release image, and the DynamoGraphDeployment manifests validated against the pinned
Dynamo release's structure plus Kubernetes' own pod schema (and failing when broken). The real Dynamo frontend in
front of kiln's CPU worker is tests/test_dynamo_serve.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kiln.recipe.containers import (
    JOB_CONTAINERS,
    LAST_ENGINE_VERSION,
    container_for,
    dynamo_image_for,
    has_engine_path,
    row_for,
)
from kiln.recipe.loader import load_recipe
from kiln.triton.deploy.dynamo import (
    DynamoDeploy,
    dynamo_image,
    graph_deployment,
    validate_graph_deployment,
    write_dynamo_files,
)
from kiln.triton.llmapi import check_llm_args, llm_args_data, llm_args_versions

from tests.conftest import CONFIGS

RECIPE = CONFIGS / "tiny-llama.yaml"
GPU_PYTORCH = ("target=pytorch", "serving.llmapi_runtime=tensorrt_llm")


def test_releases_after_1_2_1_run_in_tensorrt_llm_release_images_and_dynamo_images_pin_them() -> None:
    assert LAST_ENGINE_VERSION == "1.2.1"
    assert container_for("1.2.1") == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # Triton while it ships
    assert container_for("1.3.0rc29") == "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc29"
    assert container_for("1.4.0rc2") == "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc2"
    assert dynamo_image_for("1.3.0rc29") == "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.6.1"
    assert dynamo_image_for("1.4.0rc2") == "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.7.0"
    assert dynamo_image_for("1.2.1") is None
    for version in ("1.3.0rc29", "1.4.0rc2"):
        row = row_for(container_for(version))
        assert row is not None and row.stacks == ("trtllm-serve",) and row.min_driver and row.cuda
        assert "dynamo" in row_for(dynamo_image_for(version)).stacks
        assert not has_engine_path(version) and version in JOB_CONTAINERS
    assert has_engine_path("1.2.1") and has_engine_path("1.1.0") and not has_engine_path("1.3.0")


def test_each_release_has_its_llm_argument_table() -> None:
    assert {"1.2.1", "1.3.0rc29", "1.4.0rc2"} <= set(llm_args_versions())
    for version in ("1.3.0rc29", "1.4.0rc2"):
        data = llm_args_data(version)
        assert data["pinned"] == {"tensorrt_llm": version} and data["verified"] is False  # says it is inherited
        assert check_llm_args({"model": "ckpt", "max_batch_size": 8}, version) == []
        assert check_llm_args({"model": "ckpt", "max_batch": 8}, version) == [
            f"max_batch: unknown key (not an LLM argument of TensorRT-LLM {version})"]
    with pytest.raises(LookupError, match="known: 1.2.1, 1.3.0rc29, 1.4.0rc2"):
        llm_args_data("1.3.0")


def test_target_tensorrt_past_1_2_1_is_refused_before_any_work(kiln, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = kiln("build", RECIPE, "--set", "target=tensorrt", "--set", "engine_runtime.trtllm_version=1.4.0rc2",
                  "--dry-run")
    assert result.exit_code == 2, result.output
    assert "1.2.1 is the last version kiln builds engines with" in result.output
    assert "--set target=pytorch" in result.output
    assert not (tmp_path / "build").exists()


def test_the_dry_run_names_the_release_image_in_the_export_job(kiln, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    sets = [w for o in (*GPU_PYTORCH, "quantization.runtime=engine", "engine_runtime.trtllm_version=1.3.0rc29")
            for w in ("--set", o)]
    result = kiln("build", RECIPE, *sets, "--dry-run")
    assert result.exit_code == 0, result.output
    export = next(line for line in result.output.splitlines() if "/kiln/workers/export_hf.py" in line)
    assert " nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc29 python3 /kiln/workers/export_hf.py" in export


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[Path]]:
    recipe = load_recipe(RECIPE, GPU_PYTORCH).recipe
    out = tmp_path_factory.mktemp("dynamo-deploy")
    args = {"model": "checkpoint", "backend": "pytorch", "max_batch_size": 8}
    return out, write_dynamo_files(DynamoDeploy.from_recipe(recipe, dynamo_image(recipe)), args, out)


def test_dynamo_files_launch_script_and_graph_deployments(written) -> None:
    out, paths = written
    names = sorted(str(p.relative_to(out)) for p in paths)
    assert names == ["dynamo/README.md", "dynamo/k8s/graph-aggregated.yaml", "dynamo/k8s/graph-disaggregated.yaml",
                     "dynamo/launch.sh", "dynamo/llm_options.yaml"]
    launch = (out / "dynamo" / "launch.sh").read_text()
    assert "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.6.1" in launch
    assert "python3 -m dynamo.frontend --http-host 0.0.0.0 --http-port 8000 &" in launch
    assert "python3 -m dynamo.trtllm --model-path /models/tensorrt_llm/1/checkpoint" in launch
    assert "--extra-engine-args /kiln/dynamo/llm_options.yaml" in launch
    agg, disagg = (list(yaml.safe_load_all((out / "dynamo" / "k8s" / f).read_text()))[1]
                   for f in ("graph-aggregated.yaml", "graph-disaggregated.yaml"))
    assert [c["type"] for c in agg["spec"]["components"]] == ["frontend", "worker"]
    assert [(c["type"], c["replicas"]) for c in disagg["spec"]["components"]] == [
        ("frontend", 1), ("prefill", 1), ("decode", 1)]
    decode = disagg["spec"]["components"][2]["podTemplate"]["spec"]["containers"][0]
    assert decode["command"][-2:] == ["--disaggregation-mode", "decode"]
    assert decode["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 1}  # no plan given
    for graph in (agg, disagg):
        assert validate_graph_deployment(graph) == []
        for comp in graph["spec"]["components"]:
            req = comp["podTemplate"]["spec"]["containers"][0]["resources"]["requests"]
            assert {"cpu", "memory"} <= set(req)


def test_the_recipe_sizes_the_graph(written) -> None:
    recipe = load_recipe(RECIPE, (*GPU_PYTORCH, "parallelism.tp=2", "hardware.gpus_per_node=8",
                                  "serving.dynamo_prefill_workers=3", "serving.dynamo_decode_workers=2")).recipe
    graph = graph_deployment(DynamoDeploy.from_recipe(recipe, dynamo_image(recipe)), disaggregated=True)
    prefill, decode = graph["spec"]["components"][1:]
    assert (prefill["replicas"], decode["replicas"]) == (3, 2)
    worker = prefill["podTemplate"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["command"][worker["command"].index("--tensor-parallel-size") + 1] == "2"


@pytest.mark.parametrize("break_it, expected", [
    (lambda g: g["spec"]["components"][1].__setitem__("type", "router"),
     "spec.components.1.type: 'router' is not one of"),
    (lambda g: g["spec"]["components"][0].__setitem__("replica", 2),
     "Additional properties are not allowed ('replica' was unexpected)"),
    (lambda g: g.__setitem__("apiVersion", "nvidia.com/v1alpha1"), "apiVersion: 'nvidia.com/v1beta1' was expected"),
    (lambda g: g["spec"]["components"][1]["podTemplate"]["spec"]["containers"][0]["resources"]["requests"].pop("cpu"),
     "requests no cpu"),
    (lambda g: g["spec"]["components"][0]["podTemplate"]["spec"]["containers"][0].__setitem__("imagePullPolice", "x"),
     "podTemplate: template.spec.containers.0"),
    (lambda g: g["spec"]["components"][1]["podTemplate"]["spec"]["securityContext"].pop("runAsNonRoot"),
     "runAsNonRoot"),
    (lambda g: g["spec"]["components"][1].__setitem__("name", "decode_worker"),  # upstream's pattern (df7deed0)
     "spec.components.1.name: 'decode_worker' does not match"),
])
def test_a_broken_manifest_fails_validation(written, break_it, expected) -> None:
    out, _ = written
    graph = list(yaml.safe_load_all((out / "dynamo" / "k8s" / "graph-disaggregated.yaml").read_text()))[1]
    broken = copy.deepcopy(graph)
    break_it(broken)
    problems = validate_graph_deployment(broken, kubernetes_versions=("1.30",))
    assert any(expected in p for p in problems), problems


def _disagg(written) -> dict:
    out, _ = written
    return list(yaml.safe_load_all((out / "dynamo" / "k8s" / "graph-disaggregated.yaml").read_text()))[1]


def test_the_v1beta1_rules_the_outline_keeps(written) -> None:
    """Dynamo 1.6.1 writes planner and epp components too (the outline used to refuse them); names are unique
    case-insensitively, at most one epp, at most 25 components (the v1beta1 types' rules)."""
    graph = _disagg(written)
    planner = copy.deepcopy(graph)
    planner["spec"]["components"][2]["type"] = "planner"
    assert validate_graph_deployment(planner, kubernetes_versions=("1.30",)) == []
    twice = copy.deepcopy(graph)
    twice["spec"]["components"][2]["name"] = "PREFILL"
    assert validate_graph_deployment(twice, kubernetes_versions=("1.30",)) == [
        "DynamoGraphDeployment: spec.components: name 'prefill' appears twice (names must be unique "
        "case-insensitively)"]
    epp = copy.deepcopy(graph)
    for comp in epp["spec"]["components"][1:]:
        comp["type"] = "epp"
    assert "at most one component may have type epp" in " ".join(
        validate_graph_deployment(epp, kubernetes_versions=("1.30",)))
    many = copy.deepcopy(graph)
    many["spec"]["components"] = [dict(graph["spec"]["components"][1], name=f"w{i}") for i in range(26)]
    assert any("spec.components: " in p and "is too long" in p
               for p in validate_graph_deployment(many, kubernetes_versions=("1.30",)))


def test_the_data_says_the_stored_crd_is_not_1_6_1s() -> None:
    from kiln.triton.deploy.dynamo import dynamo_data

    crd = dynamo_data()["sources"]["crd"]
    assert crd["commit"] == "967e177cc5754a5c26c038744fd02f435600954c"
    assert crd["note"].startswith("NOT the 1.6.1 CRD") and "v1alpha1" in crd["note"]


def test_crd_schemas_are_validated_as_the_api_server_does() -> None:
    """kiln.triton.deploy.crd on a fragment of upstream's own CRD (tests/data/dynamo_crd, with its source):
    int-or-string quantities, unknown fields refused (strict), enums, bounds; CEL rules listed, not run."""
    from kiln.triton.deploy.crd import cel_rules, crd_validator

    schema = yaml.safe_load((Path(__file__).parent / "data" / "dynamo_crd" / "v1alpha1_spec_fragment.yaml").read_text())
    v = crd_validator(schema)

    def errors(doc) -> list[str]:
        return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc))

    good = {"backendFramework": "trtllm", "restart": {"id": "r1", "strategy": {"type": "Parallel"}},
            "pvcs": [{"name": "a", "size": 50}, {"name": "b", "size": "100Gi", "create": True}]}
    assert errors(good) == []
    assert errors({"pvcs": [{"name": "a", "size": 1.5}]}) == ["pvcs.0.size: 1.5 is not of type 'integer', 'string'"]
    assert errors({"pvcs": [{"name": "a", "size": "lots"}]})[0].startswith("pvcs.0.size: 'lots' does not match")
    assert errors({"pvcs": [{"name": "a", "sise": "1Gi"}]}) == [
        "pvcs.0: Additional properties are not allowed ('sise' was unexpected)"]
    assert errors({"restart": {"id": ""}, "backendFramework": "tgi"}) == [
        "backendFramework: 'tgi' is not one of ['sglang', 'vllm', 'trtllm']", "restart.id: '' should be non-empty"]
    assert [(where, msg) for where, _, msg in cel_rules(schema)] == [
        ("pvcs[]", "When create is true, size, storageClass, and volumeAccessMode are required")]
    keyed = crd_validator({"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                           "items": {"type": "object", "x-kubernetes-embedded-resource": True,
                                     "x-kubernetes-preserve-unknown-fields": True,
                                     "properties": {"name": {"type": "string"}}}})
    assert [e.message for e in keyed.iter_errors([{"name": "x", "apiVersion": "v1", "kind": "K", "extra": 1},
                                                  {"name": "x", "apiVersion": "v1"}])] == [
        "item 1 has the same name ['x'] as item 0 (x-kubernetes-list-type: map)",
        "'kind' is a required property (x-kubernetes-embedded-resource)"]


def test_kiln_checks_every_cel_rule_of_the_graph_schema_itself() -> None:
    """The CRD's CEL rules are not run offline: each one in the data has a check in validate_graph_deployment."""
    from kiln.triton.deploy.crd import cel_rules
    from kiln.triton.deploy.dynamo import dynamo_data

    messages = {msg for _, _, msg in cel_rules(dynamo_data()["graph_deployment"]["schema"])}
    assert messages == {"at most one component may have type epp",
                        "component names must be unique case-insensitively"}


def test_dynamo_1_6_1s_own_graph_templates_fit_the_schema() -> None:
    """The DynamoGraphDeployments the installed Dynamo 1.6.1 itself writes (its profiler's templates for every backend)
    pass the graph schema kiln validates against: the outline refuses nothing upstream writes."""
    from importlib import resources

    from kiln.serve.dynamo import dynamo_available
    from kiln.triton.deploy.crd import crd_validator
    from kiln.triton.deploy.dynamo import dynamo_data

    why = dynamo_available()
    if why:
        pytest.skip(why)
    validator = crd_validator(dynamo_data()["graph_deployment"]["schema"])
    root = resources.files("dynamo.profiler").joinpath("templates", "dgd")
    templates = [(f"{b.name}/{t.name}", yaml.safe_load(t.read_text())) for b in root.iterdir() if b.is_dir()
                 for t in b.iterdir() if t.name.endswith(".yaml")]
    assert len(templates) >= 6
    for name, doc in templates:
        assert doc["apiVersion"] == dynamo_data()["graph_deployment"]["apiVersion"], name
        assert [e.message for e in validator.iter_errors(doc)] == [], name
