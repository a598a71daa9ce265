"""The engine runtime: TensorRT-LLM's work runs in the NGC container (or a named interpreter), never in kiln.

No GPU and no container daemon here, so the container paths run through a STAND-IN runtime
(tests/standin_runtime: a `docker`/`podman`/`apptainer` on PATH that records its argv and runs the command in a
bubblewrap sandbox over a stand-in image whose tensorrt_llm.quantize_and_export uses this machine's ModelOpt on
the CPU, and whose trtllm-build writes an engine directory shaped like 1.2.1's without compiling anything). The
workers themselves are kiln's real ones. Nothing here is a GPU run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.recipe.loader import load_recipe
from kiln.runtime.engine_runtime import (
    SCRATCH_ENV,
    ContainerRuntime,
    Job,
    LocalRuntime,
    Mount,
    RuntimeVersions,
    check_versions,
    workers_dir,
)
from tests.standin_runtime import DIGEST, IMAGE, install

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "configs" / "tiny-llama.yaml"
TRT = ["target=tensorrt", "quantization.format=int8_sq", "quantization.calibration.samples=8",
       "quantization.calibration.max_seq_len=64", "evaluation.samples=4", "evaluation.max_seq_len=64",
       "hardware.gpu=H100-SXM"]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="the stand-in container runtime needs bubblewrap (apt-get install bubblewrap)")
ENV_FLAGS = [w for k, v in SCRATCH_ENV.items() for w in ("--env", f"{k}={v}")]


def kiln(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})


def sets(*overrides: str) -> list[str]:
    return [w for o in overrides for w in ("--set", o)]


# ------------------------------------------------------------------------------------------ command lines


def job(tmp_path: Path) -> Job:
    return Job("trtllm-build", {"checkpoint": Mount(tmp_path / "ckpt", "/kiln/in/checkpoint"),
                                "out": Mount(tmp_path / "out", "/kiln/out", read_only=False)},
               lambda p: ["trtllm-build", "--checkpoint_dir", p["checkpoint"], "--output_dir", f"{p['out']}/e"])


def test_docker_command_is_nvidias_documented_one(tmp_path: Path) -> None:
    rt = ContainerRuntime("docker", "/usr/bin/docker", IMAGE, scratch=tmp_path / "scratch", user=(1234, 56))
    argv = rt.command(job(tmp_path))
    name = argv[4]
    assert argv == [
        "/usr/bin/docker", "run", "--rm", "--name", name, "--gpus", "all", "--ipc=host",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864", "--shm-size=2g", "--user", "1234:56",
        "--volume", f"{workers_dir()}:/kiln/workers:ro",
        "--volume", f"{tmp_path / 'ckpt'}:/kiln/in/checkpoint:ro",
        "--volume", f"{tmp_path / 'out'}:/kiln/out:rw",
        "--volume", f"{tmp_path / 'scratch'}:/kiln/scratch:rw",
        *ENV_FLAGS, "--workdir", "/kiln/out", IMAGE,
        "trtllm-build", "--checkpoint_dir", "/kiln/in/checkpoint", "--output_dir", "/kiln/out/e"]
    assert name.startswith("kiln-trtllm-build-") and rt.command(job(tmp_path))[4] == name  # stable per output
    assert {"HOME": "/kiln/scratch/home", "TMPDIR": "/kiln/scratch/tmp", "HF_HOME": "/kiln/scratch/hf"}.items() \
        <= SCRATCH_ENV.items()


def test_podman_uses_cdi_and_keeps_the_callers_ids(tmp_path: Path) -> None:
    argv = ContainerRuntime("podman", "podman", IMAGE, gpus="0,1", scratch=tmp_path, user=(1234, 56),
                            rootless=True).command(job(tmp_path))
    assert argv[5:15] == ["--device", "nvidia.com/gpu=0", "--device", "nvidia.com/gpu=1", "--security-opt",
                          "label=disable", "--userns", "keep-id", "--ipc=host", "--ulimit"]
    assert "--gpus" not in argv and argv[argv.index("--user") + 1] == "1234:56"
    docker = ContainerRuntime("docker", "docker", IMAGE, gpus="0,1", scratch=tmp_path).command(job(tmp_path))
    assert docker[docker.index("--gpus") + 1] == '"device=0,1"'


def test_apptainer_for_clusters_without_docker(tmp_path: Path) -> None:
    argv = ContainerRuntime("apptainer", "apptainer", IMAGE, gpus="2", scratch=tmp_path / "s",
                            host_env={}).command(job(tmp_path))
    assert argv[:5] == ["apptainer", "exec", "--nv", "--cleanenv", "--no-home"]
    assert f"{tmp_path / 'ckpt'}:/kiln/in/checkpoint:ro" in argv and f"{tmp_path / 'out'}:/kiln/out:rw" in argv
    assert argv[argv.index("--pwd") + 1] == "/kiln/out" and "CUDA_VISIBLE_DEVICES=2" in argv
    assert argv[argv.index(f"docker://{IMAGE}") + 1:] == [
        "trtllm-build", "--checkpoint_dir", "/kiln/in/checkpoint", "--output_dir", "/kiln/out/e"]


def test_local_runtime_runs_host_paths_with_the_named_interpreter(tmp_path: Path) -> None:
    venv = tmp_path / "trtllm-venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "trtllm-build").write_text("")
    rt = LocalRuntime(interpreter=str(venv / "python"), scratch=tmp_path)
    assert rt.command(job(tmp_path)) == [str(venv / "trtllm-build"), "--checkpoint_dir", str(tmp_path / "ckpt"),
                                         "--output_dir", f"{tmp_path / 'out'}/e"]


def test_versions_must_be_the_tables() -> None:
    recipe = load_recipe(RECIPE, TRT).recipe
    good = RuntimeVersions("1.2.1", "10.14.1.48", "0.37.0", "4.57.1", "2.10.0a0")
    assert check_versions(recipe, good) == []
    bad = RuntimeVersions("1.1.0", "10.13.3.9", None, None, None)
    assert check_versions(recipe, bad) == [
        "TensorRT-LLM is 1.1.0 in the runtime, the recipe and kiln's container table say 1.2.1",
        "TensorRT is 10.13.3.9 in the runtime, kiln's container table says 10.14.1.48 for TensorRT-LLM 1.2.1"]


# ------------------------------------------------------------------------------------------ dry run, preflight


@needs_bwrap
def test_dry_run_prints_the_runtime_commands_on_any_host(tmp_path: Path) -> None:
    s = install(tmp_path / "rt", gpus=())
    run = kiln("build", str(RECIPE), *sets(*TRT), "--dry-run", cwd=tmp_path, env=s.env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"--workdir /kiln/out {IMAGE} python3 /kiln/workers/quantize.py --job /kiln/job/quantize.json" in out
    assert f"{IMAGE} python3 /kiln/workers/evaluate.py --job /kiln/job/evaluate.json" in out
    assert (f"{IMAGE} trtllm-build --checkpoint_dir /kiln/in/checkpoint --output_dir /kiln/out/trtllm_engine "
            "--max_batch_size 32") in out
    assert "quantize_and_export(qformat=int8_sq, kv_cache_dtype=None, calib_size=8" in out
    assert "preflight: no GPU on this machine" in out
    # describing and preflight start no container: only `image inspect` (the digest) and `info` (the daemon)
    assert {tuple(c["argv"][:2]) for c in s.calls("docker")} == {("image", "inspect"), ("info", "--format")}
    assert s.runs() == []


@needs_bwrap
def test_preflight_refuses_everything_at_once_before_any_work(tmp_path: Path) -> None:
    s = install(tmp_path / "rt", gpus=(), daemon_up=False)
    run = kiln("build", str(RECIPE), *sets(*TRT), cwd=tmp_path, env=s.env)
    assert run.returncode == 2, run.stdout + run.stderr
    err = run.stderr
    assert "this machine cannot run the build" in err
    assert ("no GPU on this machine: quantize, evaluate, engine run in the engine runtime" in err
            and "kiln build tiny-llama --set quantization.runtime=host --to evaluate" in err)
    assert "the docker daemon is not reachable" in err and "start it" in err
    assert not (tmp_path / "build" / "tiny-llama" / "quantize").exists()  # nothing was started
    assert s.runs() == []

    s = install(tmp_path / "rt2", images={})  # a GPU and a daemon, but the image is not here
    run = kiln("build", str(RECIPE), *sets(*TRT), cwd=tmp_path, env=s.env)
    assert run.returncode == 2
    assert f"the image {IMAGE} is not present locally: pull it first with `docker pull {IMAGE}`" in run.stderr
    assert s.runs() == []

    s = install(tmp_path / "rt3", gpus=("NVIDIA A100-SXM4-80GB",))  # the recipe names an H100
    run = kiln("build", str(RECIPE), *sets(*TRT), cwd=tmp_path, env=s.env)
    assert run.returncode == 2 and "the recipe targets H100-SXM (hardware.gpu) but this machine has" in run.stderr


def test_preflight_checks_disk_and_the_hub_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.pipeline import preflight

    loaded = load_recipe(REPO_ROOT / "configs" / "llama-3.1-8b" / "fp8.yaml")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * 2**30, 9 * 2**30,
                                                                                            2**30))
    (problem,) = preflight._disk_problems(loaded, ["quantize", "engine"], tmp_path / "build")
    assert "not enough disk under" in problem and "has 1.0 GiB free" in problem and "--build-dir" in problem
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    (token,) = preflight._token_problems(loaded.recipe, ["quantize"])
    assert "meta-llama/Llama-3.1-8B-Instruct is a gated model" in token and "HF_TOKEN" in token
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_x")
    assert preflight._token_problems(loaded.recipe, ["quantize"]) == []


# ------------------------------------------------------------------------------------------ a whole build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tensorrt build of the built-in model, every GPU step in the stand-in runtime."""
    if shutil.which("bwrap") is None:
        pytest.skip("the stand-in container runtime needs bubblewrap (apt-get install bubblewrap)")
    root = tmp_path_factory.mktemp("engine-runtime")
    s = install(root / "rt")
    run = kiln("build", str(RECIPE), *sets(*TRT), "--quiet", cwd=root, env=s.env)
    assert run.returncode == 0, run.stdout + run.stderr
    return root, s


def _by_job(s) -> dict[str, list[str]]:
    jobs = {}
    for argv in s.runs():
        command = argv[argv.index(IMAGE) + 1:]
        key = "trtllm-build" if command[0] == "trtllm-build" else Path(command[1]).stem
        jobs[key] = argv
    return jobs


def _mounts(argv: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for i, word in enumerate(argv):
        if word == "--volume":
            host, target, mode = argv[i + 1].rsplit(":", 2)
            out[target] = (host, mode)
    return out


@pytest.mark.integration
def test_every_gpu_job_ran_in_the_image_with_the_exact_flags(built) -> None:
    root, s = built
    jobs = _by_job(s)
    assert set(jobs) == {"probe", "quantize", "evaluate", "trtllm-build"}
    uid = f"{os.getuid()}:{os.getgid()}"
    build = root / "build" / "tiny-llama"
    for name, argv in jobs.items():
        assert argv[:2] == ["run", "--rm"] and argv[argv.index("--gpus") + 1] == "all", name
        assert "--ipc=host" in argv and "--shm-size=2g" in argv and argv[argv.index("--user") + 1] == uid
        assert ["--ulimit", "memlock=-1", "--ulimit", "stack=67108864"] == argv[argv.index("--ulimit"):][:4]
        mounts = _mounts(argv)
        assert mounts["/kiln/workers"] == (str(workers_dir()), "ro")
        assert mounts["/kiln/scratch"] == (str((root / "build" / ".engine-runtime").resolve()), "rw")
        writable = sorted(t for t, (_, mode) in mounts.items() if mode == "rw")
        assert writable == (["/kiln/scratch"] if name == "probe" else ["/kiln/out", "/kiln/scratch"]), name
    q = _mounts(jobs["quantize"])
    assert q["/kiln/in/model"][1] == "ro" and q["/kiln/in/calib"][1] == "ro" and q["/kiln/job"][1] == "ro"
    assert jobs["quantize"][-4:] == ["python3", "/kiln/workers/quantize.py", "--job", "/kiln/job/quantize.json"]
    assert _mounts(jobs["evaluate"])["/kiln/in/quantize"] == (str(build / "quantize"), "ro")
    e = jobs["trtllm-build"]
    assert _mounts(e)["/kiln/in/checkpoint"] == (str(build / "quantize" / "trtllm_checkpoint"), "ro")
    assert e[e.index("trtllm-build"):] == [
        "trtllm-build", "--checkpoint_dir", "/kiln/in/checkpoint", "--output_dir", "/kiln/out/trtllm_engine",
        "--max_batch_size", "32", "--max_input_len", "256", "--max_seq_len", "512", "--max_num_tokens", "2048",
        "--max_beam_width", "1", "--kv_cache_type", "paged", "--tokens_per_block", "32", "--gemm_plugin", "auto",
        "--context_fmha", "enable", "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "disable",
        "--remove_input_padding", "enable", "--multiple_profiles", "disable", "--workers", "1",
        "--logits_dtype", "float32"]


@pytest.mark.integration
def test_the_quantize_worker_got_the_recipe(built) -> None:
    root, _ = built
    job = json.loads((root / "build" / "tiny-llama" / "quantize" / "job" / "quantize.json").read_text())
    assert {k: job[k] for k in ("qformat", "kv_cache_dtype", "calib_size", "calib_max_seq_length", "tp_size",
                                "pp_size", "seed", "model_dir", "calib_dir", "output_dir")} == {
        "qformat": "int8_sq", "kv_cache_dtype": None, "calib_size": 8, "calib_max_seq_length": 64, "tp_size": 1,
        "pp_size": 1, "seed": 1234, "model_dir": "/kiln/in/model", "calib_dir": "/kiln/in/calib",
        "output_dir": "/kiln/out/trtllm_checkpoint"}
    texts = (root / "build" / "tiny-llama" / "quantize" / "job" / "calib" / "train.jsonl").read_text().splitlines()
    assert len(texts) == 8  # kiln's hashed, seeded choice: the host path calibrates on the same texts


@pytest.mark.integration
def test_versions_are_read_inside_the_runtime_and_recorded(built) -> None:
    root, _ = built
    build = root / "build" / "tiny-llama"
    engine = json.loads((build / "engine" / "manifest.json").read_text())
    assert {k: engine["result"][k] for k in ("tensorrt_llm", "tensorrt", "image", "image_digest", "built_in")} == {
        "tensorrt_llm": "1.2.1", "tensorrt": "10.14.1.48", "image": IMAGE, "image_digest": DIGEST,
        "built_in": "container"}
    assert engine["components"]["runtime"] == {"kind": "container", "image": IMAGE, "digest": DIGEST}
    quantize = json.loads((build / "quantize" / "manifest.json").read_text())["result"]["produced_by"]
    assert quantize["environment"] == f"engine runtime: {IMAGE}" and quantize["tensorrt_llm"] == "1.2.1"
    assert quantize["modelopt"]  # the ModelOpt the runtime reported (the stand-in's: this machine's)
    quality = json.loads((build / "evaluate" / "quality.json").read_text())
    assert quality["graded_in"].startswith(f"docker {IMAGE}")
    info = json.loads((root / "triton_repo" / "tiny-llama" / "kiln.json").read_text())
    assert info["engine"]["tensorrt_llm"] == "1.2.1" and info["engine"]["image_digest"] == DIGEST
    assert info["container"] == f"{IMAGE}@{DIGEST}"  # the image that built the engine, pinned
    launch = (root / "deploy" / "tiny-llama" / "docker-compose.yml").read_text()
    assert f"@{DIGEST}" in launch  # deploy files pin the image by digest


def _rebuild_engine(built, tmp_path: Path, **standin) -> subprocess.CompletedProcess:
    """Re-run only the engine step of the built recipe against another stand-in."""
    root, _ = built
    work = tmp_path / "work"
    shutil.copytree(root / "build", work / "build", symlinks=True)
    s = install(tmp_path / "rt", **standin)
    return kiln("build", str(RECIPE), *sets(*TRT), "--from", "engine", "--force", "--quiet", cwd=work, env=s.env)


@pytest.mark.integration
def test_a_runtime_with_other_versions_is_refused(built, tmp_path: Path) -> None:
    run = _rebuild_engine(built, tmp_path, trtllm="1.1.0", tensorrt="10.13.3.9")
    assert run.returncode == 1
    assert "TensorRT-LLM is 1.1.0 in the runtime, the recipe and kiln's container table say 1.2.1" in run.stderr
    assert not list((tmp_path / "work" / "build" / "tiny-llama").glob(".engine.tmp-*"))  # nothing half-built kept


@pytest.mark.integration
def test_an_engine_that_disagrees_with_the_recipe_fails_the_step(built, tmp_path: Path) -> None:
    run = _rebuild_engine(built, tmp_path, engine_override={"build_config.max_batch_size": 7})
    assert run.returncode == 1
    assert "build_config.max_batch_size: engine has 7, recipe wants 32" in run.stderr
