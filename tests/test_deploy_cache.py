"""Deploy with nothing by hand (issue 23): the packaged repository is a remote-cache entry that the deploy files'
init step pulls by digest, and pods are sized from the plan.

Fast tests check the rendered files (init container in every pod template, requests and limits on every
container, README steps, the init image's package list, figures that move with the model). The integration test
pushes the session's default build's package output to a real registry (Debian ``docker-registry``), runs the init
container's command from the rendered Deployment on this machine with the container's environment into an empty
folder, serves that folder with a real tritonserver and compares greedy text with the original's; a corrupted layer
and a version mismatch stop it with a clear message."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from registry_harness import registry_binary, start_registry

import kiln.triton.deploy as dp
from kiln.recipe.loader import load_recipe
from kiln.triton.deploy.info import INIT_MOUNT, RepoPull, sizing_for
from kiln.triton.deploy.render import INIT_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
DIGEST = "sha256:" + "ab" * 32


def _pull(**kw) -> RepoPull:
    base = dict(cache="oci://registry.example.com/kiln", tag="package-" + "cd" * 32, digest=DIGEST,
                init_image="kiln-init:0.1.0", registry_secret="kiln-registry",
                expect=("kiln.json:engine.tensorrt_llm=1.2.1",))
    return RepoPull(**{**base, **kw})


def _info(world: int = 1, gpus_per_node: int = 8, **kw) -> dp.DeployInfo:
    return dp.DeployInfo(recipe_name="llama", image="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3",
                         world_size=world, gpus_per_node=gpus_per_node, http_port=8000, grpc_port=8001,
                         metrics_port=8002, gpu=True, **kw)


def _pod_specs(objects: dict) -> list[dict]:
    specs = []
    for docs in objects.values():
        for doc in docs:
            if doc["kind"] == "Deployment":
                specs.append(doc["spec"]["template"]["spec"])
            elif doc["kind"] == dp.LWS_KIND:
                lwt = doc["spec"]["leaderWorkerTemplate"]
                specs += [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    return specs


@pytest.mark.parametrize("world", [1, 16], ids=["deployment", "leaderworkerset"])
def test_every_pod_pulls_the_repository_by_digest_and_every_container_is_sized(world, tmp_path):
    from kiln.triton.deploy.openai_sidecar import OpenAISidecar

    info = _info(world, repo_pull=_pull(), openai=OpenAISidecar("kiln-openai:0.1.0", 9000))
    written = dp.write_deploy_files(info, tmp_path)
    assert dp.validate_manifests([p for p in written if p.parent.name == "k8s"]) == []
    specs = _pod_specs(dp.k8s_objects(info))
    assert len(specs) == (1 if world == 1 else 2)
    for spec in specs:
        (init,) = spec["initContainers"]
        assert init["command"][:3] == ["python3", "-m", "kiln.cache.fetch"]
        assert init["command"][init["command"].index("--digest") + 1] == DIGEST
        repo_mounts = [m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == "model-repo"]
        assert repo_mounts and all(m["subPath"] == "sha256-" + "ab" * 32 for m in repo_mounts)
        for c in spec["containers"] + spec["initContainers"]:
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)
        auth = next(v for v in spec["volumes"] if v["name"] == "registry-auth")["secret"]
        assert auth["secretName"] == "kiln-registry" and auth["items"][0]["key"] == ".dockerconfigjson"
    compose = yaml.safe_load((tmp_path / "docker-compose.yml").read_text())
    assert compose["services"]["fetch-repo"]["command"] == _pull().command()
    assert compose["services"]["triton"]["depends_on"] == {"fetch-repo": {"condition": "service_completed_successfully"}}
    readme = (tmp_path / "README.md").read_text()
    assert "kubectl create secret docker-registry kiln-registry" in readme
    assert "1. Create a PersistentVolumeClaim" not in readme and "Option for air-gapped clusters" in readme
    assert (tmp_path / "Dockerfile.init").is_file()


def test_without_a_remote_cache_the_volume_is_filled_by_hand(tmp_path):
    dp.write_deploy_files(_info(), tmp_path)
    spec = _pod_specs(dp.k8s_objects(_info()))[0]
    assert "initContainers" not in spec
    assert "fill" in (tmp_path / "README.md").read_text() and not (tmp_path / "Dockerfile.init").exists()


def test_a_validation_without_requests_names_the_container(tmp_path):
    info = _info(repo_pull=_pull())
    docs = dp.k8s_objects(info)["deployment.yaml"]
    del docs[0]["spec"]["template"]["spec"]["initContainers"][0]["resources"]["requests"]
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    assert any("init container 'fetch-repo': resources.requests: no cpu or memory" in p
               for p in dp.validate_manifests([path]))


def test_pod_figures_move_with_the_model():
    """The planner's host memory and load time for the built-in tiny model against Llama 3.1 8B (config shipped
    with kiln): memory, load time, start-up probe and /dev/shm follow the weights and GPUs."""
    tiny = load_recipe(ROOT / "configs/tiny-llama.yaml", overrides=("target=tensorrt",)).recipe
    big = load_recipe(ROOT / "configs/tiny-llama.yaml",
                      overrides=("target=tensorrt", "model.source=hf:meta-llama/Llama-3.1-8B", "parallelism.tp=2",
                                 "model.dtype=bfloat16")).recipe
    a, b = sizing_for(tiny), sizing_for(big)
    assert "planner" in a.basis and "planner" in b.basis
    assert b.weights_bytes > 1000 * a.weights_bytes
    assert b.host_memory_bytes > a.host_memory_bytes + 4 * 2**30
    assert b.load_seconds > a.load_seconds and b.startup_seconds > a.startup_seconds
    assert b.shm_bytes > a.shm_bytes and b.cpu > a.cpu  # two GPUs on the pod: NCCL buffers, CPU per GPU
    info_a = _info(sizing=a)
    info_b = _info(world=2, sizing=b)
    probe = lambda info: dp.k8s_objects(info)["deployment.yaml"][0]["spec"]["template"]["spec"]["containers"][0]
    assert probe(info_b)["startupProbe"]["failureThreshold"] > probe(info_a)["startupProbe"]["failureThreshold"]
    assert probe(info_b)["resources"]["requests"]["memory"] != probe(info_a)["resources"]["requests"]["memory"]


def test_init_image_must_be_pinned_by_digest_when_set(kiln, write_recipe):
    path = write_recipe((ROOT / "configs/tiny-llama.yaml").read_text() + "  init_image: kiln-init:1\n")
    result = kiln("validate", path)
    assert result.exit_code != 0 and "serving.init_image" in result.output and "pinned by digest" in result.output
    unpinned = load_recipe(ROOT / "configs/tiny-llama.yaml",
                           overrides=("target=tensorrt", "cache.remote=oci://r.example.com/k")).warnings
    assert any(w.key == "serving.init_image" for w in unpinned)


def _third_party_imports(package: Path) -> set[str]:
    names = set()
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("kiln", "__future__")}


def test_the_init_image_installs_what_kiln_cache_imports():
    src = ROOT / "src" / "kiln"
    needed = _third_party_imports(src / "cache") | _third_party_imports(src / "util")
    listed = {p.split(">")[0].split("=")[0].split("<")[0] for p in INIT_PACKAGES}
    assert needed <= listed, f"Dockerfile.init lacks {needed - listed}"


# ------------------------------------------------------------------ the init command against a real registry


@pytest.mark.integration
@pytest.mark.skipif(registry_binary() is None, reason="docker-registry is not installed (apt-get install "
                    "docker-registry; .ci/run does)")
def test_the_init_command_pulls_the_package_entry_and_it_serves_the_same_text(default_build, default_server,
                                                                              tmp_path):
    from kiln.pipeline.remote import RemoteCache
    from kiln.pipeline.runner import schedule
    from kiln.serve.client import generate_http
    from kiln.serve.server import free_port
    from kiln.util.artifacts import read_manifest

    loaded, layout, repo = default_build
    registry = start_registry(tmp_path / "registry")
    try:
        remote = RemoteCache(registry.url(), loaded.recipe.cache, progress=False)
        p = next(s for s in schedule(loaded, layout) if s.spec.name == "package")
        source = remote.entry_source(p, p.out_dir)  # before any push: the digest from the content alone
        assert remote.push(p, p.out_dir, read_manifest(p.out_dir), built_here=True)
        assert remote.registry.get_manifest(source.tag)[1] == source.digest

        def init(expect: tuple[str, ...], into: Path) -> subprocess.CompletedProcess:
            pull = RepoPull(source.cache, source.tag, source.digest, "kiln-init:test", "kiln-registry", expect=expect)
            info = _info(repo_pull=pull)
            (container,) = dp.k8s_objects(info)["deployment.yaml"][0]["spec"]["template"]["spec"]["initContainers"]
            argv = [sys.executable if w == "python3" else w.replace(INIT_MOUNT, str(into)) for w in container["command"]]
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("KILN_REGISTRY_")},
                   **{e["name"]: e["value"] for e in container["env"]}, "HOME": str(tmp_path)}
            env["DOCKER_CONFIG"] = str(tmp_path / "no-secret-mounted")  # the optional Secret, absent
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)

        ok = init(("kiln.json:recipe=tiny-llama", f"kiln.json:fingerprint={p.fingerprint}"), tmp_path / "vol")
        assert ok.returncode == 0, ok.stderr
        pulled = tmp_path / "vol" / source.digest.replace(":", "-")
        assert "every layer verified" in ok.stdout
        files = read_manifest(pulled)["files"]
        assert all((pulled / f).read_bytes() == (repo / f).read_bytes() for f in files)

        mismatch = init(("kiln.json:engine.tensorrt_llm=1.2.1",), tmp_path / "vol2")
        assert mismatch.returncode == 1 and "refused" in mismatch.stderr
        assert "records engine.tensorrt_llm = None; this deployment's image needs '1.2.1'" in mismatch.stderr
        assert not (tmp_path / "vol2" / pulled.name).exists()

        from kiln.cache import artifact

        entry = artifact.read_entry(remote.registry, source.digest)
        victim = max(entry.parts, key=lambda part: part.size)
        blob = registry.blob_path(victim.digest)
        original = blob.read_bytes()
        blob.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
        try:
            corrupt = init((), tmp_path / "vol3")
        finally:
            blob.write_bytes(original)
        assert corrupt.returncode == 1 and victim.digest in corrupt.stderr, corrupt.stderr
        assert "Traceback" not in corrupt.stderr and not (tmp_path / "vol3" / pulled.name).exists()
    finally:
        registry.stop()

    # `kiln serve` on the pulled folder (a real tritonserver, detached), then `kiln stop`
    http = free_port()
    serve = [sys.executable, "-m", "kiln", "serve", str(pulled), "--background", "--http-port", str(http),
             "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--timeout", "240"]
    work = tmp_path / "serve"
    work.mkdir()
    started = subprocess.run(serve, cwd=work, capture_output=True, text=True, timeout=300)
    prompt = "The quick brown fox"
    try:
        assert started.returncode == 0, started.stderr
        served = generate_http(f"http://127.0.0.1:{http}", prompt, 16)
    finally:
        subprocess.run([sys.executable, "-m", "kiln", "stop", str(pulled)], cwd=work, capture_output=True, timeout=120)
    assert served == generate_http(default_server.urls()["http"], prompt, 16)
    assert json.loads((pulled / "kiln.json").read_text())["fingerprint"] == p.fingerprint


def test_recorded_versions_that_disagree_are_refused_all_at_once(tmp_path):
    from kiln.cache.fetch import Refused, check_expectations

    (tmp_path / "kiln.json").write_text(json.dumps({"engine": {"tensorrt_llm": "1.1.0", "tensorrt": "10.11.0"}}))
    check_expectations(tmp_path, [("kiln.json", "engine.tensorrt_llm", "1.1.0")], "entry")
    with pytest.raises(Refused) as err:
        check_expectations(tmp_path, [("kiln.json", "engine.tensorrt_llm", "1.2.1"),
                                      ("kiln.json", "engine.tensorrt", "10.14.1.48")], "entry")
    assert "engine.tensorrt_llm = '1.1.0'; this deployment's image needs '1.2.1'" in str(err.value)
    assert "engine.tensorrt = '10.11.0'" in str(err.value) and "Rebuild" in str(err.value)


def test_every_dynamo_service_pulls_the_repository_and_is_sized_from_the_plan():
    from kiln.triton.deploy.dynamo import DynamoDeploy, dynamo_image, graph_deployment, validate_graph_deployment

    recipe = load_recipe(ROOT / "configs/tiny-llama.yaml", overrides=(
        "target=pytorch", "serving.llmapi_runtime=tensorrt_llm", "model.source=hf:meta-llama/Llama-3.1-8B",
        "model.dtype=bfloat16", "quantization.format=fp8")).recipe
    sizing = sizing_for(recipe)
    d = DynamoDeploy.from_recipe(recipe, dynamo_image(recipe), repo_pull=_pull(), sizing=sizing)
    for disaggregated in (False, True):
        graph = graph_deployment(d, disaggregated)
        assert validate_graph_deployment(graph) == []
        for component in graph["spec"]["components"]:
            spec = component["podTemplate"]["spec"]
            assert spec["initContainers"][0]["command"] == _pull().command()
            for c in spec["containers"] + spec["initContainers"]:
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"][kind]), (component["name"], c["name"], kind)
            if component["type"] != "frontend":
                assert spec["containers"][0]["resources"]["requests"]["memory"] == f"{sizing.memory_mib}Mi"
