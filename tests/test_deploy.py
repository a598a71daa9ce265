"""Deployment files (kiln.triton.deploy): launch script, Docker Compose, Kubernetes manifests and their checks.

The shell scripts are run for real with stand-in ``tritonserver``/``mpirun`` executables that record their
argv, so what the scripts start is compared with what :func:`launch_command` says, word for word.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kiln.recipe.schema import Recipe
from kiln.triton import deploy as dp
from kiln.triton.deploy import DeployInfo
from kiln.triton.deploy.openai_sidecar import OpenAISidecar
from kiln.util.errors import InputError
from tests.standins import serving_site, stub_repository

IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
SIDECAR = OpenAISidecar("kiln-openai:0.1.0", 9000)
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")

# (id, world size, gpus per node, gpu): one GPU, one node of 4, two nodes of 8, and the CPU reference target.
CASES = [
    ("tp1", 1, 8, True),
    ("tp4", 4, 8, True),
    ("tp8pp2", 16, 8, True),
    ("reference", 1, 8, False),
]


def make_info(world_size: int = 1, gpus_per_node: int = 8, gpu: bool = True, **kw: Any) -> DeployInfo:
    fields: dict[str, Any] = dict(
        recipe_name="llama_3.1-8b.fp8",
        image=IMAGE,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        http_port=8000,
        grpc_port=8001,
        metrics_port=8002,
        gpu=gpu,
    )
    fields.update(kw)
    return DeployInfo(**fields)


@pytest.fixture(params=CASES, ids=[c[0] for c in CASES])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[DeployInfo, Path, list[Path]]:
    """A DeployInfo, its deploy directory (``<tmp>/deploy/<recipe>``, repository at ``<tmp>/triton_repo/<recipe>``)
    and the paths written."""
    _, world_size, gpn, gpu = request.param
    info = make_info(world_size, gpn, gpu, hub_token_secret="hf-token", openai=SIDECAR)  # the sidecar is on by default
    repo = tmp_path / "triton_repo" / info.recipe_name
    repo.mkdir(parents=True)
    out = tmp_path / "deploy" / info.recipe_name
    return info, out, dp.write_deploy_files(info, out, model_repo=repo)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def pod_templates(out: Path) -> list[dict[str, Any]]:
    """Every pod template in the written k8s files."""
    templates = []
    for path in sorted((out / "k8s").glob("*.yaml")):
        for doc in load_all(path):
            if doc["kind"] == "Deployment":
                templates.append(doc["spec"]["template"])
            elif doc["kind"] == "LeaderWorkerSet":
                lwt = doc["spec"]["leaderWorkerTemplate"]
                templates += [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return templates


# ------------------------------------------------------------------------------------------ files


def test_files_written(case: tuple[DeployInfo, Path, list[Path]]) -> None:
    info, out, paths = case
    rel = sorted(str(p.relative_to(out)) for p in paths)
    k8s = (
        ["k8s/configmap.yaml", "k8s/leaderworkerset.yaml", "k8s/service.yaml"]
        if info.multi_node
        else ["k8s/deployment.yaml", "k8s/service.yaml"]
    )
    assert rel == sorted(["README.md", "docker-compose.yml", "launch.sh", "Dockerfile.openai", *k8s]
                         + (["Dockerfile.multinode"] if info.multi_node else []))
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == rel
    assert (out / "launch.sh").stat().st_mode & stat.S_IXUSR
    readme = (out / "README.md").read_text()
    assert "docker compose up" in readme and "kubectl apply -f k8s/" in readme
    assert dp.pvc_name(info) in readme
    if not info.gpu:
        assert "test and development vehicle" in readme


def test_stale_k8s_files_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "deploy" / "r"
    dp.write_deploy_files(make_info(16), out)
    assert (out / "k8s" / "leaderworkerset.yaml").exists()
    dp.write_deploy_files(make_info(4), out)
    assert sorted(p.name for p in (out / "k8s").iterdir()) == ["deployment.yaml", "service.yaml"]


# ------------------------------------------------------------------------------------- launch command


@pytest.mark.parametrize("world_size", [1, 4, 16])
def test_launch_command_per_rank_flags(world_size: int) -> None:
    info = make_info(world_size, tensorrt_llm_model_names=("tensorrt_llm", "tensorrt_llm_draft"))
    ranks = dp.launch_command(info, "/models")
    assert len(ranks) == world_size
    for rank, argv in enumerate(ranks):
        assert argv[0] == "tritonserver"
        for flag in ("--model-repository=/models", "--http-port=8000", "--grpc-port=8001",
                     "--metrics-port=8002", "--disable-auto-complete-config"):
            assert argv.count(flag) == 1, (rank, flag)
        prefixes = [a for a in argv if a.startswith("--backend-config=python,shm-region-prefix-name=")]
        assert prefixes == ([f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"] if world_size > 1 else [])
        if rank == 0:  # loads the whole repository and serves
            assert not any(a.startswith(("--model-control-mode", "--load-model", "--allow-")) for a in argv)
        else:
            assert "--model-control-mode=explicit" in argv
            assert [a for a in argv if a.startswith("--load-model=")] == [
                "--load-model=tensorrt_llm", "--load-model=tensorrt_llm_draft"]
            assert {"--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"} <= set(argv)


def test_mpirun_command_joins_one_context_per_rank() -> None:
    info = make_info(4)
    argv = dp.mpirun_command(info, "/models", mpirun_args=["--hostfile", "h"])
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "--hostfile", "h"]
    contexts: list[list[str]] = [[]]
    for word in argv[4:]:
        contexts.append([]) if word == ":" else contexts[-1].append(word)
    assert contexts == [["-n", "1", *r] for r in dp.launch_command(info, "/models")]
    assert dp.server_command(make_info(1), "/m") == dp.launch_command(make_info(1), "/m")[0]
    assert dp.server_command(info, "/m")[0] == "mpirun"


def test_reference_target_uses_no_gpu_metrics_and_one_rank() -> None:
    argv = dp.launch_command(make_info(gpu=False), "/models")
    assert argv == [[*argv[0]]] and "--allow-gpu-metrics=false" in argv[0]
    assert "--allow-gpu-metrics=false" not in dp.launch_command(make_info(), "/models")[0]
    with pytest.raises(InputError, match="parallelism.tp"):
        make_info(2, gpu=False)


def _fake_bin(tmp_path: Path) -> tuple[Path, Path]:
    """A bin directory whose tritonserver and mpirun write their argv (one word per line) to a record file."""
    bin_dir, record = tmp_path / "bin", tmp_path / "argv.txt"
    bin_dir.mkdir()
    for name in ("tritonserver", "mpirun"):
        exe = bin_dir / name
        exe.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" {name} "$@" > "{record}"\n'
                       f'printf "HOSTFILE=%s\\n" "${{KILN_MPI_HOSTFILE:-}}" >> "{record}.env"\n')
        exe.chmod(0o755)
    return bin_dir, record


def _env(bin_dir: Path, site: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a stand-in serving container: the fake binaries first on PATH and, on PYTHONPATH, the
    metadata of the TensorRT-LLM/TensorRT the engine check reads (standins.serving_site)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "LWS_", "MODEL_REPO", "PYTHONPATH"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env.update(extra)
    return env


def _served_repo(record: Path) -> Path:
    """The repository tritonserver was started on (launch.sh serves a shadow repository outside /models)."""
    return Path(next(w for w in record.read_text().splitlines() if w.startswith("--model-repository="))
                .split("=", 1)[1])


@needs_bash
@pytest.mark.parametrize("world_size", [1, 4, 16])
def test_launch_sh_runs_exactly_the_launch_command(world_size: int, tmp_path: Path) -> None:
    info = make_info(world_size)
    out = tmp_path / "deploy"
    dp.write_deploy_files(info, out)
    bin_dir, record = _fake_bin(tmp_path)
    repo = stub_repository(tmp_path / "my repo")  # a space: the path must stay one word
    run = subprocess.run([BASH, str(out / "launch.sh")],
                         env=_env(bin_dir, serving_site(tmp_path), MODEL_REPO=str(repo)),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert record.read_text().splitlines() == dp.server_command(info, str(_served_repo(record)))


@needs_bash
def test_launch_sh_multi_node_adds_hostfile_and_prefix(tmp_path: Path) -> None:
    info = make_info(16)
    out = tmp_path / "deploy"
    dp.write_deploy_files(info, out)
    bin_dir, record = _fake_bin(tmp_path)
    repo = stub_repository(tmp_path / "repo")
    run = subprocess.run([BASH, str(out / "launch.sh")],
                         env=_env(bin_dir, serving_site(tmp_path), MODEL_REPO=str(repo), KILN_MPI_HOSTFILE="/tmp/hosts"),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    words = record.read_text().splitlines()
    expected_args = ["--hostfile", "/tmp/hosts", "--prefix", str(tmp_path), "-x", "PATH", "-x", "LD_LIBRARY_PATH",
                     "-x", "HOME"]
    assert words == dp.mpirun_command(info, str(_served_repo(record)), mpirun_args=expected_args)


@needs_bash
def test_launch_sh_refuses_a_missing_repository(tmp_path: Path) -> None:
    dp.write_deploy_files(make_info(), tmp_path / "deploy")
    bin_dir, record = _fake_bin(tmp_path)
    run = subprocess.run([BASH, str(tmp_path / "deploy" / "launch.sh")],
                         env=_env(bin_dir, MODEL_REPO=str(tmp_path / "nope")), capture_output=True, text=True)
    assert run.returncode == 2 and "MODEL_REPO" in run.stderr and not record.exists()


@needs_bash
def test_leader_sh_writes_hostfile_and_runs_launch_sh(tmp_path: Path) -> None:
    info = make_info(16)
    out = tmp_path / "deploy"
    dp.write_deploy_files(info, out)
    scripts = load_all(out / "k8s" / "configmap.yaml")[0]["data"]
    assert scripts["launch.sh"] == (out / "launch.sh").read_text()
    scripts_dir, keys = tmp_path / "scripts", tmp_path / "keys"
    scripts_dir.mkdir()
    keys.mkdir()
    for name, text in scripts.items():
        (scripts_dir / name).write_text(text)
    (keys / "id_ed25519").write_text("not a real key\n")
    bin_dir, record = _fake_bin(tmp_path)
    common = dict(KILN_SCRIPTS_DIR=str(scripts_dir), KILN_SSH_KEYS=str(keys), KILN_SSH_STATE=str(tmp_path / "state"),
                  MODEL_REPO=str(stub_repository(tmp_path / "repo")), LWS_LEADER_ADDRESS="llama-0.llama.serving",
                  PYTHONPATH=str(serving_site(tmp_path)))

    # A group of one pod: no worker to wait for; the hostfile lists this node with its GPUs.
    run = subprocess.run([BASH, str(scripts_dir / "leader.sh")], env=_env(bin_dir, LWS_GROUP_SIZE="1", **common),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    hostfile = tmp_path / "state" / "hostfile"
    assert hostfile.read_text().split() == [subprocess.check_output(["hostname"], text=True).strip(), "slots=8"]
    words = record.read_text().splitlines()
    assert words[:4] == ["mpirun", "--allow-run-as-root", "--hostfile", str(hostfile)]
    assert oct((tmp_path / "state" / "id_ed25519").stat().st_mode & 0o777) == "0o600"

    # Two pods: the worker's name comes from LWS_LEADER_ADDRESS; with no sshd there it gives up, naming it.
    run = subprocess.run([BASH, str(scripts_dir / "leader.sh")],
                         env=_env(bin_dir, LWS_GROUP_SIZE="2", KILN_WORKER_WAIT_S="0", **common),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1
    assert "llama-0-1.llama.serving" in run.stderr and str(dp.SSH_PORT) in run.stderr


@needs_bash
def test_worker_sh_explains_a_missing_sshd(tmp_path: Path) -> None:
    if shutil.which("sshd") or Path("/usr/sbin/sshd").exists():
        pytest.skip("this machine has sshd; the check is for images without it")
    text = dp.render_worker_script(make_info(16))
    (tmp_path / "worker.sh").write_text(text)
    run = subprocess.run([BASH, str(tmp_path / "worker.sh")], capture_output=True, text=True, timeout=30,
                         env=_env(tmp_path, KILN_SSH_KEYS=str(tmp_path), KILN_SSH_STATE=str(tmp_path / "s")))
    assert run.returncode == 1 and "openssh-server" in run.stderr


@needs_bash
def test_scripts_parse(tmp_path: Path) -> None:
    info = make_info(16)
    for name, text in (("launch.sh", dp.render_launch_script(info)), ("leader.sh", dp.render_leader_script(info)),
                       ("worker.sh", dp.render_worker_script(info))):
        (tmp_path / name).write_text(text)
        run = subprocess.run([BASH, "-n", str(tmp_path / name)], capture_output=True, text=True)
        assert run.returncode == 0, (name, run.stderr)
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


# ---------------------------------------------------------------------------------------------- compose


def test_compose(case: tuple[DeployInfo, Path, list[Path]]) -> None:
    info, out, _ = case
    doc = yaml.safe_load((out / "docker-compose.yml").read_text())
    svc = doc["services"]["triton"]
    assert svc["image"] == IMAGE
    assert svc["command"] == dp.server_command(info, "/models")
    if info.gpu:
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": info.world_size, "capabilities": ["gpu"]}]
    else:
        assert "deploy" not in svc
        assert "test and development vehicle" in (out / "docker-compose.yml").read_text()
    assert svc["ports"] == ["8000:8000", "8001:8001", "8002:8002"]
    assert svc["ulimits"] == {"memlock": -1, "stack": 67108864}
    assert re.fullmatch(r"\d+gb", svc["shm_size"])
    assert svc["healthcheck"]["test"] == ["CMD", "curl", "-fsS", "http://localhost:8000/v2/health/ready"]
    (volume,) = svc["volumes"]
    assert volume["target"] == "/models" and volume["read_only"] is True
    assert (out / volume["source"]).resolve() == (out.parent.parent / "triton_repo" / info.recipe_name).resolve()
    # The token is passed by name from the caller's environment, never written.
    assert "HF_TOKEN" in svc["environment"] and not any(e.startswith("HF_TOKEN=") for e in svc["environment"])


def test_compose_default_repository_path(tmp_path: Path) -> None:
    info = make_info()
    out = tmp_path / "deploy" / info.recipe_name
    dp.write_deploy_files(info, out)
    source = yaml.safe_load((out / "docker-compose.yml").read_text())["services"]["triton"]["volumes"][0]["source"]
    assert source == f"../../triton_repo/{info.recipe_name}"


# ------------------------------------------------------------------------------------------- Kubernetes


def test_manifests_validate_strictly_offline(case: tuple[DeployInfo, Path, list[Path]]) -> None:
    _, out, paths = case
    manifests = [p for p in paths if p.parent.name == "k8s"]
    versions = dp.default_kubernetes_versions()
    assert versions[0] == dp.MIN_KUBERNETES_VERSION
    assert versions[-1] == ".".join(kubernetes_validate.latest_version().split(".")[:2])
    assert dp.validate_manifests(manifests) == []
    # And one by one, straight through kubernetes-validate (strict) for the core kinds.
    for path in manifests:
        for doc in load_all(path):
            if doc["kind"] != dp.LWS_KIND:
                for version in versions:
                    assert kubernetes_validate.validate(doc, version, strict=True)


def test_pods_follow_policy(case: tuple[DeployInfo, Path, list[Path]]) -> None:
    info, out, _ = case
    templates = pod_templates(out)
    assert len(templates) == (2 if info.multi_node else 1)
    for template in templates:
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model-repo"]["persistentVolumeClaim"] == {"claimName": dp.pvc_name(info), "readOnly": True}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        container, *sidecars = spec["containers"]
        assert [c["name"] for c in sidecars] in ([], ["openai"])
        for other in sidecars:  # the same policy for the OpenAI sidecar
            assert other["securityContext"] == container["securityContext"]
            assert "readinessProbe" in other and "livenessProbe" in other
        assert container["image"] == IMAGE
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 1000
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True and mounts["/dev/shm"]["name"] == "dshm"
        limits = container["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == (info.gpus_per_pod if info.gpu else None)
        assert "readinessProbe" in container and "livenessProbe" in container
        for var in container["env"]:
            assert "value" not in var or not dp.SECRETISH_ENV.search(var["name"]), var
            if var["name"] == "HF_TOKEN":
                assert var["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}


def test_server_pod_probes_and_scrape_annotations(case: tuple[DeployInfo, Path, list[Path]]) -> None:
    info, out, _ = case
    server = pod_templates(out)[0]  # the Deployment's pod or the LWS leader
    container = server["spec"]["containers"][0]
    assert container["name"] == "triton"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert server["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "8002", "prometheus.io/path": "/metrics"}
    assert any(v["name"] == "HF_TOKEN" for v in container["env"])
    (service,) = load_all(out / "k8s" / "service.yaml")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "http": (8000, "http"), "grpc": (8001, "grpc"), "metrics": (8002, "metrics"), "openai": (9000, "openai")}
    assert service["spec"]["selector"].items() <= server["metadata"]["labels"].items()
    if not info.multi_node:
        (deployment,) = load_all(out / "k8s" / "deployment.yaml")
        assert container["command"] == dp.server_command(info, "/models")
        assert deployment["spec"]["selector"]["matchLabels"].items() <= server["metadata"]["labels"].items()


def test_leaderworkerset_fields(tmp_path: Path) -> None:
    info = make_info(16, 8, hub_token_secret="hf-token")
    out = tmp_path / "deploy"
    dp.write_deploy_files(info, out)
    (lws,) = load_all(out / "k8s" / "leaderworkerset.yaml")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["startupPolicy"] == "LeaderCreated"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]
    assert leader["containers"][0]["command"] == ["bash", "/opt/kiln/leader.sh"]
    assert worker["containers"][0]["command"] == ["bash", "/opt/kiln/worker.sh"]
    for spec in (leader, worker):
        resources = spec["containers"][0]["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == 8 and "nvidia.com/gpu" not in resources["requests"]
        assert resources["requests"]["cpu"] == "18"  # 2 + 2 per GPU (kiln.plan.host)
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["mpi-ssh"]["secret"]["secretName"] == dp.ssh_secret_name(info)
        assert volumes["scripts"]["configMap"]["name"].endswith("-scripts")
    assert worker["containers"][0]["readinessProbe"] == {
        "tcpSocket": {"port": "ssh"}, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3}
    assert not any(v["name"] == "HF_TOKEN" for v in worker["containers"][0]["env"])
    (service,) = load_all(out / "k8s" / "service.yaml")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "leader"
    # LWS names its own headless Service (pod DNS) after the LWS: ours must not take that name.
    assert service["metadata"]["name"] == dp.service_name(info) != lws["metadata"]["name"]
    assert f"svc/{dp.service_name(info)} " in (out / "README.md").read_text()
    assert "&id" not in (out / "k8s" / "leaderworkerset.yaml").read_text()  # no YAML anchors/aliases


def test_multi_node_world_size_must_fill_whole_nodes() -> None:
    with pytest.raises(InputError, match="multiple of gpus_per_node"):
        dp.k8s_objects(make_info(12, 8))
    assert make_info(12, 8).pods_per_group == 2
    assert "deployment.yaml" in dp.k8s_objects(make_info(8, 8))


# ------------------------------------------------------------------------- the validator can fail


def _write(tmp_path: Path, docs: list[dict[str, Any]], name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def _objects(world_size: int) -> dict[str, list[dict[str, Any]]]:
    return copy.deepcopy(dp.k8s_objects(make_info(world_size, hub_token_secret="hf-token")))


def test_validator_catches_unknown_container_field(tmp_path: Path) -> None:
    (deployment,) = _objects(4)["deployment.yaml"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"  # typo
    problems = dp.validate_manifests([_write(tmp_path, [deployment])])
    assert problems and all("imagePullPolcy" in p for p in problems)
    assert "spec.template.spec.containers.0" in problems[0] and "strict" in problems[0]


@pytest.mark.parametrize("probe", ["readinessProbe", "livenessProbe"])
def test_validator_catches_missing_probe(tmp_path: Path, probe: str) -> None:
    (deployment,) = _objects(1)["deployment.yaml"]
    del deployment["spec"]["template"]["spec"]["containers"][0][probe]
    assert dp.validate_manifests([_write(tmp_path, [deployment])]) == [
        f"m.yaml: Deployment/{deployment['metadata']['name']} template: container 'triton': no {probe}"]


def test_validator_catches_inline_secret_root_and_bad_shm(tmp_path: Path) -> None:
    (deployment,) = _objects(1)["deployment.yaml"]
    spec = deployment["spec"]["template"]["spec"]
    spec["containers"][0]["env"].append({"name": "HF_TOKEN", "value": "hf_abc"})
    spec["securityContext"]["runAsNonRoot"] = False
    spec["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    spec["volumes"][1] = {"name": "dshm", "emptyDir": {}}
    problems = "\n".join(dp.validate_manifests([_write(tmp_path, [deployment])]))
    assert "HF_TOKEN: a secret value inline" in problems
    assert "runAsNonRoot: must be true" in problems
    assert "allowPrivilegeEscalation: must be false" in problems
    assert "/dev/shm: must be an emptyDir with medium: Memory" in problems


def test_validator_catches_required_field_and_bad_name(tmp_path: Path) -> None:
    objects = _objects(1)
    (deployment,), (service,) = objects["deployment.yaml"], objects["service.yaml"]
    del deployment["spec"]["selector"]
    service["metadata"]["name"] = "9-Bad_Name"
    problems = "\n".join(dp.validate_manifests([_write(tmp_path, [deployment, service])]))
    assert "'selector' is a required property" in problems
    assert "'9-Bad_Name' is not a DNS-1123 label" in problems


def test_validator_checks_leaderworkerset_fields_and_templates(tmp_path: Path) -> None:
    (lws,) = _objects(16)["leaderworkerset.yaml"]
    assert dp.validate_manifests([_write(tmp_path, [lws])]) == []
    broken = copy.deepcopy(lws)
    lwt = broken["spec"]["leaderWorkerTemplate"]
    broken["spec"]["replica"] = 2  # typo of replicas
    lwt["restartPolicy"] = "Always"
    lwt["size"] = 0
    lwt["workerTemplate"]["spec"]["containers"][0]["resource"] = {}  # typo of resources
    del lwt["leaderTemplate"]["spec"]["containers"][0]["readinessProbe"]
    problems = dp.validate_manifests([_write(tmp_path, [broken])])
    text = "\n".join(problems)
    assert "spec.replica: unknown field" in text
    assert "spec.leaderWorkerTemplate.restartPolicy: 'Always' is not one of" in text
    assert "spec.leaderWorkerTemplate.size: 0 is not an integer ≥ 1" in text
    assert "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0: Additional properties are not allowed" in text
    assert "leaderTemplate: container 'triton': no readinessProbe" in text

    for mutate, expected in [
        (lambda d: d.update(apiVersion="leaderworkerset.x-k8s.io/v1beta1"), "apiVersion"),
        (lambda d: d["spec"]["leaderWorkerTemplate"].pop("workerTemplate"), "workerTemplate: missing"),
        (lambda d: d["spec"].update(rolloutStrategy={"rollingUpdateConfiguration": {}}),
         "rolloutStrategy.type: missing"),
        (lambda d: d["spec"].update(startupPolicy="Eventually"), "spec.startupPolicy: 'Eventually'"),
    ]:
        doc = copy.deepcopy(lws)
        mutate(doc)
        assert expected in "\n".join(dp.validate_manifests([_write(tmp_path, [doc])])), expected


def test_validator_reports_unreadable_and_unknown_kinds(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed\n")
    assert "cannot read as YAML" in dp.validate_manifests([bad])[0]
    crd = _write(tmp_path, [{"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}])
    assert "no schema" in dp.validate_manifests([crd])[0]


# ------------------------------------------------------------------------------------ names and inputs


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [("llama_3.1-8b.fp8", "llama-3-1-8b-fp8"), ("7b-chat", "kiln-7b-chat"), ("tiny", "tiny"), ("a..b__c", "a-b-c")],
)
def test_k8s_name(recipe: str, expected: str) -> None:
    assert dp.k8s_name(recipe) == expected


def test_k8s_name_long_names_stay_distinct_and_valid() -> None:
    a, b = "x" * 80 + "-int4", "x" * 80 + "-fp8"
    names = {dp.k8s_name(a), dp.k8s_name(b)}
    assert len(names) == 2
    for name in names:
        assert len(name) <= dp.NAME_MAX and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(grpc_port=8000), "must differ"),
        (dict(http_port=70000), "serving.http_port"),
        (dict(world_size=0), "world size"),
        (dict(image="has space"), "image"),
        (dict(hub_token_secret="Not_Valid"), "Secret name"),
        (dict(tensorrt_llm_model_names=()), "at least one model"),
        (dict(world_size=16, http_port=dp.SSH_PORT), "sshd"),
    ],
)
def test_deploy_info_rejects_bad_input(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(InputError, match=match):
        make_info(**kw)


def test_from_recipe() -> None:
    recipe = Recipe.model_validate(
        {"name": "big", "parallelism": {"tp": 8, "pp": 2}, "hardware": {"gpus_per_node": 8},
         "serving": {"http_port": 9000, "grpc_port": 9001, "metrics_port": 9002, "openai_port": 9003}}
    )
    info = DeployInfo.from_recipe(recipe, IMAGE, hub_token_secret="hf", draft_model_name="draft_llm")
    assert info.openai is not None and (info.openai.port, info.openai.triton_model) == (9003, "ensemble")
    assert (info.world_size, info.gpus_per_node, info.multi_node, info.pods_per_group, info.gpus_per_pod) == (
        16, 8, True, 2, 8)
    assert (info.http_port, info.grpc_port, info.metrics_port, info.gpu) == (9000, 9001, 9002, True)
    assert info.tensorrt_llm_model_names == ("tensorrt_llm", "draft_llm")
    reference = DeployInfo.from_recipe(Recipe.model_validate({"name": "ref", "target": "reference"}), IMAGE)
    assert reference.gpu is False and reference.gpus_per_pod == 0


# ---------------------------------------------------------------------------- GPU-path defects (issue 11)


@needs_bash
def test_launch_sh_with_model_repo_elsewhere_points_the_engine_paths_there(tmp_path: Path) -> None:
    """Defect: config.pbtxt names /models/<model>/1/engine while launch.sh offers MODEL_REPO, so the backend
    found no engine ("Both encoder and decoder model paths are empty"). launch.sh now serves a shadow
    repository whose tensorrt_llm configs point into MODEL_REPO, and whose other entries are the originals."""
    info = make_info(1, tensorrt_llm_model_names=("tensorrt_llm", "tensorrt_llm_draft"))
    out = tmp_path / "deploy"
    dp.write_deploy_files(info, out)
    bin_dir, record = _fake_bin(tmp_path)
    repo = stub_repository(tmp_path / "elsewhere" / "repo", models=("tensorrt_llm", "tensorrt_llm_draft"))
    run = subprocess.run([BASH, str(out / "launch.sh")], env=_env(bin_dir, serving_site(tmp_path), MODEL_REPO=str(repo)),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    served = _served_repo(record)
    assert served != repo
    for model in ("tensorrt_llm", "tensorrt_llm_draft"):
        text = (served / model / "config.pbtxt").read_text()
        path = re.search(r'string_value: "([^"]+)"', text).group(1)
        assert path == str(repo / model / "1" / "engine") and Path(path, "rank0.engine").is_file()
        assert (served / model / "1").resolve() == (repo / model / "1").resolve()  # the engine is linked, not copied


@needs_bash
def test_launch_sh_refuses_an_engine_built_by_other_versions(tmp_path: Path) -> None:
    """The engine check runs before tritonserver: a container with another TensorRT-LLM is refused, with the
    command that rebuilds the engine for it."""
    out = tmp_path / "deploy"
    dp.write_deploy_files(make_info(1), out)
    bin_dir, record = _fake_bin(tmp_path)
    repo = stub_repository(tmp_path / "repo", trtllm="1.2.1", tensorrt="10.14.1.48")
    run = subprocess.run([BASH, str(out / "launch.sh")],
                         env=_env(bin_dir, serving_site(tmp_path, "1.1.0", "10.13.3.9"), MODEL_REPO=str(repo),
                                  NVIDIA_TRITON_SERVER_VERSION="26.02"),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 3 and not record.exists()
    assert "tensorrt_llm: the engine was built with 1.2.1, this environment has 1.1.0" in run.stderr
    assert ("kiln build stub --from engine --set engine_runtime.image="
            "nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3") in run.stderr


def test_multi_node_pods_run_the_derived_image_with_sshd(tmp_path: Path) -> None:
    """Defect: the LeaderWorkerSet ran the stock NGC image, whose worker has no sshd. Its pods now run the derived
    image that Dockerfile.multinode builds (the serving image plus OpenSSH)."""
    info = make_info(16, multinode_image="registry.example.com/team/kiln-mn:26.07")
    out = tmp_path / "deploy"
    dp.write_deploy_files(info, out)
    lws = load_all(out / "k8s" / "leaderworkerset.yaml")[0]["spec"]["leaderWorkerTemplate"]
    images = {c["image"] for t in ("leaderTemplate", "workerTemplate") for c in lws[t]["spec"]["containers"]}
    assert images == {"registry.example.com/team/kiln-mn:26.07"}
    dockerfile = (out / "Dockerfile.multinode").read_text()
    assert f"ARG BASE_IMAGE={IMAGE}" in dockerfile and "openssh-server" in dockerfile
    default = make_info(16, multinode_image=dp.multinode_image_name(IMAGE))
    assert default.multinode_image == "kiln-trtllm-multinode:26.07-trtllm-python-py3" != IMAGE
    single = tmp_path / "single"
    dp.write_deploy_files(make_info(8), single)
    assert not (single / "Dockerfile.multinode").exists()


def test_draft_target_with_tp_runs_in_orchestrator_mode() -> None:
    """Defect: draft+target with tp × pp > 1 needs TensorRT-LLM's orchestrator mode (upstream's --multi-model)."""
    info = make_info(2, tensorrt_llm_model_names=("tensorrt_llm", "tensorrt_llm_draft"), orchestrator_gpus=3)
    argv = dp.server_command(info, "/models")
    assert argv[:3] == ["env", "TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1"]
    assert argv[3] == "tritonserver" and "mpirun" not in argv  # one process spawns the ranks
    assert [a for a in argv if a.startswith("--cuda-memory-pool-byte-size=")] == [
        "--cuda-memory-pool-byte-size=0:0", "--cuda-memory-pool-byte-size=1:0", "--cuda-memory-pool-byte-size=2:0"]
    assert "--enable-peer-access=false" in argv and "--pinned-memory-pool-byte-size=0" in argv
    assert "export TRTLLM_ORCHESTRATOR=1" in dp.render_launch_script(info)
    with pytest.raises(InputError, match="one node"):
        make_info(16, tensorrt_llm_model_names=("tensorrt_llm", "tensorrt_llm_draft"), orchestrator_gpus=16)

# ------------------------------------------------------------------------------------------ the OpenAI sidecar


def test_openai_sidecar_in_compose_and_kubernetes(case: tuple[DeployInfo, Path, list[Path]]) -> None:
    """The same app as `kiln serve --openai`, beside Triton: a Compose service and a container of the serving pod
    (the leader's in a LeaderWorkerSet), reaching Triton's gRPC port and reading the repository read-only."""
    info, out, _ = case
    expected_args = ["--triton-model", "ensemble", "--repo", "/models", "--host", "0.0.0.0", "--port", "9000"]
    svc = yaml.safe_load((out / "docker-compose.yml").read_text())["services"]["openai"]
    assert svc["image"] == SIDECAR.image and svc["ports"] == ["9000:9000"]
    assert svc["command"] == ["python3", "-m", "kiln.serve.openai", "--triton-url", "triton:8001", *expected_args]
    assert svc["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert svc["volumes"][0]["read_only"] is True and svc["volumes"][0]["target"] == "/models"
    serving = [t for t in pod_templates(out) if t["metadata"]["labels"]["app.kubernetes.io/component"] != "worker"]
    for template in serving:
        sidecar = next(c for c in template["spec"]["containers"] if c["name"] == "openai")
        assert sidecar["command"] == ["python3", "-m", "kiln.serve.openai", "--triton-url", "127.0.0.1:8001",
                                      *expected_args]
        assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
        assert sidecar["volumeMounts"] == [{"name": "model-repo", "mountPath": "/models", "readOnly": True}]
    workers = [t for t in pod_templates(out) if t["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert all(len(t["spec"]["containers"]) == 1 for t in workers), "workers serve nothing"
    [service] = load_all(out / "k8s" / "service.yaml")
    assert {"name": "openai", "port": 9000, "targetPort": "openai", "protocol": "TCP"} in service["spec"]["ports"]
    dockerfile = (out / "Dockerfile.openai").read_text()
    assert f"-t {SIDECAR.image}" in dockerfile and "--no-deps /opt/kiln" in dockerfile and "USER 1000:1000" in dockerfile
    readme = (out / "README.md").read_text()
    assert "/v1/completions" in readme and "openai_frontend/main.py" in readme, "the sidecar and Triton's own frontend"


def test_openai_sidecar_off_and_port_clash(tmp_path: Path) -> None:
    info = make_info()
    paths = dp.write_deploy_files(info, tmp_path / "d")
    assert "openai" not in yaml.safe_load((tmp_path / "d" / "docker-compose.yml").read_text())["services"]
    assert not (tmp_path / "d" / "Dockerfile.openai").exists() and len(paths) == 5
    with pytest.raises(InputError, match="serving.openai_port must differ"):
        make_info(openai=OpenAISidecar("kiln-openai:0.1.0", 8001))
    recipe = Recipe.model_validate({"name": "r", "serving": {"openai_sidecar": False}})
    assert DeployInfo.from_recipe(recipe, IMAGE).openai is None
