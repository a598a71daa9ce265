"""The serving commands on the command line: `kiln serve --background`, `kiln infer`, `kiln bench`, `kiln stop`
against the default recipe's real build (conftest.default_build) and a real tritonserver; `kiln serve --docker`
with a stand-in `docker` executable; `kiln plan` on a shipped GPU recipe.

`kiln serve --background` and `kiln stop` run as real processes (the server must outlive the command that
started it; the state file lives under the working directory's build/.serve/); the client commands run
in-process through click's runner.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from kiln.recipe.catalog import configs_dir
from kiln.serve.server import free_port

CONFIGS = configs_dir()
DEFAULT_RECIPE = CONFIGS / "tiny-llama.yaml"
PROMPTS = ["def fibonacci(n):", "class Config:\n    \"\"\"", "import os\nimport"]
MAX_TOKENS = 16


def kiln_process(*args: object, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def manifest_times(build_root: Path) -> dict[str, str]:
    return {str(p.relative_to(build_root)): json.loads(p.read_text())["started"]
            for p in sorted(build_root.glob("*/*/manifest.json"))}


def processes_with(needle: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``needle`` (e.g. a server's unique port flag)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and needle in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


# ============================================================================ serve --background, infer, bench, stop
@dataclass
class Background:
    work: Path
    http: str
    grpc: str
    http_port: int
    started: subprocess.CompletedProcess
    manifests_before: dict[str, str]
    manifests_after: dict[str, str]

    @property
    def state_file(self) -> Path:
        return self.work / "build" / ".serve" / "tiny-llama.json"


@pytest.fixture(scope="module")
def background(default_build, tmp_path_factory):
    """`kiln serve configs/tiny-llama.yaml --background` on the already built default recipe (its build and repo
    folders passed with --build-dir/--repo-dir), from a fresh working directory. Stopped at the end if a test
    left it running."""
    _, layout, _ = default_build
    work = tmp_path_factory.mktemp("cli-serve")
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    before = manifest_times(layout.build_root)
    started = kiln_process("serve", DEFAULT_RECIPE, "--background", "--build-dir", layout.build_root,
                           "--repo-dir", layout.repo_root, "--http-port", ports["http"], "--grpc-port", ports["grpc"],
                           "--metrics-port", ports["metrics"], "--timeout", 240, cwd=work)
    bg = Background(work, f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}", ports["http"], started,
                    before, manifest_times(layout.build_root))
    yield bg
    if bg.state_file.exists():
        kiln_process("stop", cwd=work)


@pytest.mark.integration
def test_serve_background_detaches_once_ready_without_rebuilding(background, default_build):
    started = background.started
    assert started.returncode == 0, started.stderr[-3000:]
    assert background.manifests_after == background.manifests_before, "every step was up to date: none re-ran"
    out = started.stdout
    assert out.startswith(f"ready: {default_build[2].resolve()}")
    assert f"http    {background.http}   (POST {background.http}/v2/models/ensemble/generate)" in out
    assert f"grpc    {background.grpc}" in out and "stop with: kiln stop" in out
    assert "test and development vehicle" in started.stderr  # the reference target says what it is
    state = json.loads(background.state_file.read_text())
    assert state["ready"] is True and state["urls"]["http"] == background.http
    assert psutil.pid_exists(state["pid"]), "the detached `kiln serve` outlives the command that started it"
    assert requests.get(f"{background.http}/v2/health/ready", timeout=10).status_code == 200


@pytest.mark.integration
def test_serve_background_twice_is_refused(background, default_build):
    again = kiln_process("serve", default_build[2], "--background", "--http-port", free_port(), cwd=background.work)
    pid = json.loads(background.state_file.read_text())["pid"]
    assert again.returncode == 2
    assert f"already running (pid {pid}" in again.stderr and "kiln stop" in again.stderr
    assert "Traceback" not in again.stderr


@pytest.mark.integration
@pytest.mark.parametrize("mode", [[], ["--no-stream"], ["--model", "tensorrt_llm_bls"]],
                         ids=["grpc-stream", "http-no-stream", "bls"])
def test_infer_prints_the_greedy_completion(kiln, background, hf_greedy, mode):
    for prompt in PROMPTS[:2]:
        result = kiln("infer", prompt, "--url", background.grpc, "--http-url", background.http,
                      "--max-tokens", MAX_TOKENS, *mode)
        assert result.exit_code == 0, result.output
        assert result.output == hf_greedy(prompt, MAX_TOKENS) + "\n"


@pytest.mark.integration
def test_infer_reports_a_refused_request_as_an_error(kiln, background):
    result = kiln("infer", "hello", "--url", background.grpc, "--max-tokens", 1_000_000)
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "max_seq_len" in result.output


@pytest.mark.integration
def test_bench_writes_json_csv_and_png_that_agree(kiln, background, hf_greedy, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "expected": hf_greedy(p, MAX_TOKENS)}) + "\n"
                               for p in PROMPTS))
    out = tmp_path / "bench"
    # the planner predicts float16 GEMMs (the tiny model is float32, for which no GPU has a tensor-core figure)
    fp16 = tmp_path / "tiny-fp16.yaml"
    fp16.write_text(f"extends: {DEFAULT_RECIPE}\nname: tiny-llama\nmodel:\n  dtype: float16\n")
    result = kiln("bench", "--url", background.grpc, "--concurrency", "1,2", "--duration", "1", "--output-len",
                  MAX_TOKENS, "--input-len", 8, "--prompts", prompts, "--out", out, "--recipe", fp16,
                  "--gpu", "H100-SXM")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    assert report["total_errors"] == 0 and report["config"]["output_len"] == MAX_TOKENS
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        assert lv["completed"] >= 1 and lv["errors"] == 0 and lv["mismatches"] == 0  # served = HF greedy
        assert lv["output_tokens_per_s"] > 0 and 0 < lv["ttft_p50_ms"] <= lv["e2e_p50_ms"]
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for row, lv in zip(rows, levels):
        assert int(row["completed"]) == lv["completed"] and int(row["errors_mismatch"]) == 0
        assert float(row["e2e_p50_ms"]) == pytest.approx(lv["e2e_p50_ms"])
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
    # --recipe/--gpu: each level's measured figures next to `kiln plan`'s speed model for the same workload
    assert "vs plan" in result.output and "x plan" in result.output and "kiln plan speed model" in result.output, \
        result.output
    assert f"wrote {out / 'bench.json'}, {out / 'bench.csv'}, {out / 'bench.png'}" in result.output


@pytest.mark.integration
def test_bench_exits_1_when_outputs_do_not_match(kiln, background, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({PROMPTS[0]: "certainly not what the model says"}))
    result = kiln("bench", "--url", background.grpc, "--concurrency", "1", "--duration", "1", "--output-len",
                  MAX_TOKENS, "--prompts", prompts, "--out", tmp_path / "bench")
    assert result.exit_code == 1
    assert "request(s) failed or mismatched" in result.output
    level = json.loads((tmp_path / "bench" / "bench.json").read_text())["levels"][0]
    assert level["mismatches"] >= 1 and level["mismatches"] == level["errors"]


@pytest.mark.integration
def test_stop_ends_the_server_and_removes_its_state(background):
    pid = json.loads(background.state_file.read_text())["pid"]
    assert processes_with(f"--http-port={background.http_port}"), "the tritonserver is running before the stop"
    stopped = kiln_process("stop", cwd=background.work)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "stopped 1 server(s)"
    assert not background.state_file.exists()
    deadline = time.monotonic() + 30
    while (psutil.pid_exists(pid) or processes_with(f"--http-port={background.http_port}")) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not processes_with(f"--http-port={background.http_port}"), "its tritonserver is gone too"
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{background.http}/v2/health/ready", timeout=5)
    again = kiln_process("stop", cwd=background.work)
    assert again.returncode == 0 and again.stdout.strip() == "no kiln server was running"


# ============================================================================ serve --docker (stand-in docker)
STANDIN_DOCKER = """#!{python}
# A stand-in for `docker` (no container runtime runs here): records its argv as JSON and exits with $DOCKER_EXIT.
import json, os, sys
with open(os.environ["DOCKER_ARGV_FILE"], "w") as fh:
    json.dump(sys.argv[1:], fh)
sys.exit(int(os.environ.get("DOCKER_EXIT", "0")))
"""


@pytest.fixture
def standin_docker(tmp_path, monkeypatch) -> Path:
    """A `docker` stand-in first on PATH; returns the file its argv is recorded in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(STANDIN_DOCKER.format(python=sys.executable))
    docker.chmod(0o755)
    argv_file = tmp_path / "docker-argv.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_ARGV_FILE", str(argv_file))
    return argv_file


def tiny_tokenizer() -> Path:
    """A tokenizer folder for the stand-in repositories: the cached built-in model's."""
    from kiln.models.tiny import ensure_tiny_llama

    return ensure_tiny_llama(progress=False)


def tensorrt_repository(recipe_file: Path, tokenizer_dir: Path, tmp: Path) -> tuple[Path, str]:
    """A tensorrt-target repository of a shipped GPU recipe, packaged by kiln's writer around a stand-in engine
    config (no GPU here to build the engine); TensorRT-LLM 1.2.1, so kiln.json names the NGC container."""
    from kiln.recipe.loader import load_recipe
    from kiln.triton.repository import RepoInputs, standin_engine_config, write_repository

    recipe = load_recipe(recipe_file).recipe
    engine = tmp / "engine"
    engine.mkdir(parents=True)
    (engine / "config.json").write_text(json.dumps(standin_engine_config(recipe, recipe.engine.max_seq_len,
                                                                         version="1.2.1")))
    out = tmp / "repo" / recipe.name
    out.mkdir(parents=True)
    info = write_repository(RepoInputs(recipe, tokenizer_dir, engine, None, "fp",
                                       {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48"}), out,
                            recipe.engine.max_seq_len)
    return out, info["container"]


DOCKER_RUN = ["run", "--rm", "--gpus", "all", "--ipc=host", "--shm-size=4g", "--ulimit", "memlock=-1", "--ulimit",
              "stack=67108864"]
CHECK = "python3 /models/kiln_check_engine.py /models && exec "


def test_serve_docker_runs_the_ngc_container_on_the_repository(kiln, standin_docker, tmp_path, monkeypatch):
    repo, image = tensorrt_repository(CONFIGS / "llama-3.1-8b" / "fp8.yaml", tiny_tokenizer(), tmp_path)
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-trtllm-python-py3", image)
    result = kiln("serve", repo, "--docker")
    assert result.exit_code == 0, result.output
    # the engine check first (it refuses an engine built by other TensorRT-LLM/TensorRT versions), then
    # kiln.json's server command
    assert json.loads(standin_docker.read_text()) == [
        *DOCKER_RUN, "-p127.0.0.1:8000:8000", "-p127.0.0.1:8001:8001", "-p127.0.0.1:8002:8002",
        "-v", f"{repo.resolve()}:/models:ro", image, "bash", "-c",
        CHECK + "tritonserver --model-repository=/models --http-port=8000 --grpc-port=8001 --metrics-port=8002 "
        "--disable-auto-complete-config",
    ]
    assert "$ docker run --rm --gpus all" in result.output  # the command is shown before it runs

    monkeypatch.setenv("DOCKER_EXIT", "3")  # the container's exit status is kiln's
    result = kiln("serve", repo, "--docker", "--host", "0.0.0.0", "--http-port", "9000", "--grpc-port", "9001",
                  "--metrics-port", "9002")
    assert result.exit_code == 3
    argv = json.loads(standin_docker.read_text())
    # host ports are the caller's, mapped onto the ports the repository's server command listens on
    assert argv[len(DOCKER_RUN):len(DOCKER_RUN) + 3] == ["-p0.0.0.0:9000:8000", "-p0.0.0.0:9001:8001",
                                                        "-p0.0.0.0:9002:8002"]


def test_serve_docker_on_a_podman_only_host_runs_podman_with_cdi(kiln, tmp_path, monkeypatch):
    """No docker here, podman is: `kiln serve --docker` runs the same container with podman's GPU and IPC flags."""
    repo, image = tensorrt_repository(CONFIGS / "llama-3.1-8b" / "fp8.yaml", tiny_tokenizer(), tmp_path)
    bin_dir = tmp_path / "podman-bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text(STANDIN_DOCKER.format(python=sys.executable).replace("`docker`", "`podman`"))
    (bin_dir / "podman").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("DOCKER_ARGV_FILE", str(tmp_path / "podman-argv.json"))
    result = kiln("serve", repo, "--docker")
    assert result.exit_code == 0, result.output
    argv = json.loads((tmp_path / "podman-argv.json").read_text())
    assert argv[:8] == ["run", "--rm", "--device", "nvidia.com/gpu=all", "--security-opt", "label=disable",
                        "--ipc=host", "--ulimit"]
    assert image in argv and not any(a.startswith("--shm-size") for a in argv)
    assert "$ podman run --rm --device nvidia.com/gpu=all" in result.output


def test_the_task_gate_serves_a_gpu_repository_with_the_engine_its_jobs_ran_in(tmp_path, monkeypatch):
    """With docker and podman both here, the gate's container runs under the engine the build's jobs used (podman
    here), not whichever comes first on PATH. Both engines are stand-ins that record their argv and exit."""
    from kiln.serve.endpoint import openai_endpoint
    from kiln.serve.server import ServerError

    repo, image = tensorrt_repository(CONFIGS / "llama-3.1-8b" / "fp8.yaml", tiny_tokenizer(), tmp_path)
    bin_dir = tmp_path / "engines"
    bin_dir.mkdir()
    for name in ("docker", "podman"):
        (bin_dir / name).write_text(STANDIN_DOCKER.format(python=sys.executable)
                                    .replace('os.environ["DOCKER_ARGV_FILE"]', f'"{tmp_path / name}.json"'))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(ServerError, match="exited"):
        with openai_endpoint(repo, tmp_path / "state", tmp_path / "logs", gpu_here=True,
                             engine="podman", exe=str(bin_dir / "podman")):
            pass
    argv = json.loads((tmp_path / "podman.json").read_text())
    assert argv[:4] == ["run", "--rm", "--device", "nvidia.com/gpu=all"] and image in argv
    assert not (tmp_path / "docker.json").exists()


def test_serve_docker_tp4_runs_one_tritonserver_per_rank_under_mpirun(kiln, standin_docker, tmp_path):
    repo, image = tensorrt_repository(CONFIGS / "llama-3.1-70b" / "fp8-tp4.yaml",
                                      tiny_tokenizer(), tmp_path)
    result = kiln("serve", repo, "--docker")
    assert result.exit_code == 0, result.output
    argv = json.loads(standin_docker.read_text())
    server = ["tritonserver", "--model-repository=/models", "--http-port=8000", "--grpc-port=8001",
              "--metrics-port=8002", "--disable-auto-complete-config"]
    # leader mode, as upstream's launch_triton_server.py: rank 0 serves every model and the endpoints; the
    # other ranks load only tensorrt_llm, each rank with its own Python-backend shared-memory prefix
    ranks = []
    for rank in range(4):
        ranks += ["-n", "1", *server, f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        if rank:
            ranks += ["--model-control-mode=explicit", "--load-model=tensorrt_llm", "--allow-http=false",
                      "--allow-grpc=false", "--allow-metrics=false"]
        if rank < 3:
            ranks.append(":")
    import shlex

    assert argv == [*DOCKER_RUN, "-p127.0.0.1:8000:8000", "-p127.0.0.1:8001:8001", "-p127.0.0.1:8002:8002",
                    "-v", f"{repo.resolve()}:/models:ro", image, "bash", "-c",
                    CHECK + shlex.join(["mpirun", "--allow-run-as-root", *ranks])]


def test_serve_docker_refuses_a_reference_repository_and_a_missing_docker(kiln, default_build, tmp_path,
                                                                           monkeypatch, standin_docker):
    result = kiln("serve", default_build[2], "--docker")
    assert result.exit_code == 2 and "names no serving container" in result.output
    assert not standin_docker.exists(), "nothing was run"
    repo, _ = tensorrt_repository(CONFIGS / "llama-3.1-8b" / "fp8.yaml",
                                  tiny_tokenizer(), tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    result = kiln("serve", repo, "--docker")
    assert result.exit_code == 2 and "docker is not installed here" in result.output
    assert "Traceback" not in result.output


def test_the_serving_command_under_podman_gets_gpus_through_cdi_and_no_shm_size(tmp_path, monkeypatch):
    """The doctor serves with the engine its jobs ran in: podman refuses --shm-size beside --ipc=host (exit 125,
    container_engines.yaml) and takes GPUs as CDI devices; docker's command stays NVIDIA's documented one."""
    from kiln.runtime.engine_runtime import argv_problems
    from kiln.serve.server import ServerConfig
    from kiln.serve.session import docker_command, serving_engine
    from kiln.util.errors import InputError

    info = {"container": "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3",
            "server_command": ["tritonserver", "--model-repository=/models", "--http-port=8000"]}
    cfg = ServerConfig(repo=tmp_path, http_port=9000, grpc_port=9001, metrics_port=9002)
    podman = docker_command(tmp_path, info, cfg, engine="podman", exe="/usr/bin/podman")
    assert podman[:10] == ["/usr/bin/podman", "run", "--rm", "--device", "nvidia.com/gpu=all", "--security-opt",
                           "label=disable", "--ipc=host", "--ulimit", "memlock=-1"]
    assert not any(a.startswith("--shm-size") for a in podman) and "--gpus" not in podman
    assert podman[podman.index("-p127.0.0.1:9000:8000") + 1:][:3] == ["-v", f"{tmp_path.resolve()}:/models:ro",
                                                                     info["container"]]
    assert argv_problems("podman", podman, rootless=False, host_env={}) == []
    docker = docker_command(tmp_path, info, cfg, engine="docker", exe="docker")
    assert docker[1:len(DOCKER_RUN) + 1] == DOCKER_RUN
    with pytest.raises(InputError, match="docker or podman, not apptainer"):
        docker_command(tmp_path, info, cfg, engine="apptainer", exe="apptainer")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text("#!/bin/sh\n")
    (bin_dir / "podman").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert serving_engine() == ("podman", str(bin_dir / "podman"))  # the only one here
    assert serving_engine("apptainer") == ("podman", str(bin_dir / "podman"))  # apptainer publishes no ports
    assert serving_engine("docker", "/opt/docker") == ("docker", "/opt/docker")  # the jobs' engine first


# ============================================================================ plan
def test_plan_prints_the_tables_and_json_of_a_shipped_gpu_recipe(kiln):
    from kiln.plan import plan_for
    from kiln.recipe.loader import load_recipe

    recipe = CONFIGS / "llama-3.1-8b" / "fp8.yaml"
    as_json = kiln("plan", recipe, "--json")
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.output)
    loaded = load_recipe(recipe)
    expected = plan_for(loaded, "H100-SXM")
    from kiln.plan.workers import recipe_worker_memory

    workers = data.pop("workers")  # the engine-runtime workers' memory check, beside the serving plan
    assert data == json.loads(json.dumps(expected.to_dict()))  # the planner's answer, for the recipe's GPU
    assert workers == json.loads(json.dumps(recipe_worker_memory(loaded, expected).to_dict()))
    assert data["gpu"]["name"] == "H100-SXM" and data["weights"]["format"] == "fp8"

    table = kiln("plan", recipe)
    assert table.exit_code == 0, table.output
    text = table.output
    assert "meta-llama/Llama-3.1-8B-Instruct (8.03 B params, 32 layers" in text
    assert f"{data['kv_cache']['tokens']:,} tokens in {data['kv_cache']['blocks']:,} blocks" in text
    assert "1 × H100-SXM" in text and "Verdict:" in text and "Decode roofline" in text

    other = json.loads(kiln("plan", recipe, "--gpu", "H200", "--set", "engine.max_seq_len=6144", "--json").output)
    assert other["gpu"]["name"] == "H200" and other["settings"]["max_seq_len"] == 6144
    assert other["kv_cache"]["tokens"] > data["kv_cache"]["tokens"]  # 141 GB instead of 80

    a100 = kiln("plan", recipe, "--gpu", "A100-80GB")
    assert a100.exit_code == 0  # a plan is advice: it says what does not run, and why
    assert "Verdict: does not run on A100-80GB: FP8 needs SM 89+ but A100-80GB is SM 80" in a100.output


def test_plan_bad_gpu_or_no_gpu_exits_2_with_the_known_names(kiln):
    result = kiln("plan", CONFIGS / "llama-3.1-8b" / "fp8.yaml", "--gpu", "H900")
    assert result.exit_code == 2 and "unknown GPU 'H900'; known:" in result.output and "H100-SXM" in result.output
    result = kiln("plan", DEFAULT_RECIPE)  # the default recipe names no GPU
    assert result.exit_code == 2 and "no GPU to plan for: pass --gpu" in result.output
