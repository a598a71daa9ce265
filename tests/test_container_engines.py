"""The container engines' own rules for the command lines kiln generates (src/kiln/runtime/data/container_engines.yaml,
each rule with the engine's source lines): podman refuses `--shm-size` with `--ipc=host` and `--userns keep-id` when
rootful; Apptainer's `--cleanenv` drops the scheduler's GPU binding. No engine runs here: the rules are checked on
the argv, and podman's rootless answer comes from a STAND-IN `podman` that prints what `podman info` would.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from kiln.runtime.engine_runtime import ContainerRuntime, Job, Mount, argv_problems, engine_rules, podman_rootless
from kiln.util.errors import KilnError
from tests.standin_runtime import IMAGE


def job(tmp_path: Path) -> Job:
    return Job("quantize", {"model": Mount(tmp_path / "model", "/kiln/in/model"),
                            "out": Mount(tmp_path / "out", "/kiln/out", read_only=False)},
               lambda p: ["python3", f"{p['workers']}/quantize.py"])


@pytest.mark.parametrize("rootless", [True, False])
def test_podman_command_breaks_none_of_podmans_rules(tmp_path: Path, rootless: bool) -> None:
    argv = ContainerRuntime("podman", "podman", IMAGE, scratch=tmp_path, user=(1234, 56),
                            rootless=rootless).command(job(tmp_path))
    assert "--ipc=host" in argv and not any(a.startswith("--shm-size") for a in argv)
    assert (["--userns", "keep-id"] == argv[argv.index("--userns"):][:2]) if rootless else "--userns" not in argv
    assert argv[argv.index("--user") + 1] == "1234:56"  # outputs stay the caller's either way
    assert argv_problems("podman", argv, rootless=rootless, host_env={}) == []


def test_the_rules_refuse_what_podman_refuses() -> None:
    old = ["podman", "run", "--ipc=host", "--shm-size=2g", "--userns", "keep-id", IMAGE]
    rootful = argv_problems("podman", old, rootless=False, host_env={})
    assert len(rootful) == 2
    assert "cannot set shmsize when running in the host IPC Namespace" in rootful[0]
    assert "containers/podman pkg/specgen/container_validate.go" in rootful[0]
    assert "keep-id is only supported in rootless mode" in rootful[1]
    assert len(argv_problems("podman", old, rootless=True, host_env={})) == 1
    assert argv_problems("podman", ["podman", "run", "--ipc", "host", "--shm-size", "1g"], rootless=True,
                         host_env={})  # either spelling of both flags
    assert argv_problems("docker", ["docker", "run", "--ipc=host", "--shm-size=2g"], rootless=False,
                         host_env={}) == []  # docker accepts both (NVIDIA's documented flags)


def test_a_refused_command_is_never_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = ContainerRuntime("podman", "podman", IMAGE, scratch=tmp_path, rootless=False)
    monkeypatch.setattr(ContainerRuntime, "_command", lambda self, j: ["podman", "run", "--userns", "keep-id"])
    with pytest.raises(KilnError, match="keep-id is only supported in rootless mode"):
        rt.command(job(tmp_path))


def test_apptainer_keeps_slurms_gpu_binding_through_cleanenv(tmp_path: Path) -> None:
    rt = ContainerRuntime("apptainer", "apptainer", IMAGE, scratch=tmp_path, host_env={"CUDA_VISIBLE_DEVICES": "2,3"})
    argv = rt.command(job(tmp_path))
    assert "--cleanenv" in argv and argv[argv.index("CUDA_VISIBLE_DEVICES=2,3") - 1] == "--env"
    dropped = [a for a in argv if a != "CUDA_VISIBLE_DEVICES=2,3"]
    assert "drops the host's CUDA_VISIBLE_DEVICES" in argv_problems("apptainer", dropped, rootless=False,
                                                                     host_env={"CUDA_VISIBLE_DEVICES": "2,3"})[0]
    unbound = ContainerRuntime("apptainer", "apptainer", IMAGE, scratch=tmp_path, host_env={}).command(job(tmp_path))
    assert not any(a.startswith("CUDA_VISIBLE_DEVICES=") for a in unbound)  # no binding: every GPU, as before


def _standin_podman(tmp_path: Path, answer: str, code: int = 0) -> str:
    exe = tmp_path / "podman"
    exe.write_text(f"#!/bin/sh\n# STAND-IN podman: answers `podman info --format ...` only\necho {answer}\nexit {code}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_rootless_is_what_podman_info_says(tmp_path: Path) -> None:
    assert podman_rootless(_standin_podman(tmp_path, "true")) is True
    assert podman_rootless(_standin_podman(tmp_path, "false")) is False
    assert podman_rootless(_standin_podman(tmp_path, "error", 125)) is (os.geteuid() != 0)
    argv = ContainerRuntime("podman", _standin_podman(tmp_path, "false"), IMAGE, scratch=tmp_path).command(job(tmp_path))
    assert "keep-id" not in argv


def test_every_rule_names_its_source_lines() -> None:
    data = engine_rules()
    for rule in data["rules"]:
        src = data["sources"][rule["source"]]
        assert src["repo"] and src["path"] and len(src["commit"]) == 40 and src["lines"].strip(), rule["id"]


def test_dry_run_under_podman_shows_no_shm_size_with_host_ipc(kiln, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20's acceptance: `kiln build <recipe> --dry-run --set engine_runtime.container_engine=podman`."""
    recipe = str(Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "fp8.yaml")
    result = kiln("build", recipe, "--dry-run", "--set", "engine_runtime.container_engine=podman")
    runs = [line for line in result.output.splitlines() if "podman run" in line]
    assert len(runs) == 3, result.output  # quantize, evaluate, trtllm-build
    for line in runs:
        assert "--ipc=host" in line and "--shm-size" not in line
        if shutil.which("podman") is None:  # no podman to ask: root means rootful
            assert ("--userns keep-id" in line) == (os.geteuid() != 0)
