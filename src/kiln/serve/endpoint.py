"""An OpenAI-compatible endpoint for a packaged repository, for tools that measure a served model (the task gate).

:func:`openai_endpoint` yields the endpoint of a repository: a running ``kiln serve --openai`` of the same,
current repository when there is one (its state file under ``build/.serve``), else a server started here and
stopped on exit — a real ``tritonserver`` on this machine for the CPU reference target, or for the tensorrt target
the NGC serving container named in the repository's ``kiln.json`` (``docker run``, on a GPU host only) — with
kiln's OpenAI-compatible server in front.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from kiln.serve.openai import OpenAIConfig, OpenAIServer
from kiln.serve.server import ServerConfig, ServerError, TritonServer, free_port, tail
from kiln.serve.session import docker_command, serving_engine, serving_record, state_file_for
from kiln.util.errors import InputError


@dataclass(frozen=True)
class Endpoint:
    url: str
    """The OpenAI base URL (``http://host:port/v1``)."""
    model: str
    """The model id to send."""
    how: str
    """How it is served, for reports (``reused kiln serve (pid N)``, ``tritonserver here (CPU reference …)``)."""


def repository_info(repo: Path) -> dict:
    path = Path(repo) / "kiln.json"
    if not path.is_file():
        raise InputError(f"{repo} is not a packaged kiln repository (no kiln.json): run the package step first")
    return json.loads(path.read_text(encoding="utf-8"))


def _answers(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=timeout) as resp:  # noqa: S310 - a local URL
            return resp.status == 200
    except OSError:
        return False


def running_endpoint(repo: Path, state_dir: Path) -> Optional[Endpoint]:
    """A running ``kiln serve REPO --openai`` of this repository (its serving record), started after the repository
    was written (a server started before a repackage serves the old model) and answering ``/v1/models``; else None."""
    repo = Path(repo).resolve()
    record = serving_record(repo, state_dir)
    url = ((record.running or {}).get("urls") or {}).get("openai")
    manifest = repo / "manifest.json"
    if not url or not manifest.is_file():
        return None
    if state_file_for(repo, state_dir).stat().st_mtime < manifest.stat().st_mtime or not _answers(url):
        return None
    return Endpoint(url=url, model=repository_info(repo).get("recipe") or repo.name,
                    how=f"reused the running kiln serve (pid {record.running.get('pid')}, {url})")


@contextlib.contextmanager
def _front(repo: Path, triton_grpc: str, model: str) -> Iterator[str]:
    front = OpenAIServer(OpenAIConfig(triton_url=triton_grpc, triton_model=model, repo=repo, port=free_port()))
    front.start()
    try:
        yield f"{front.cfg.url}/v1"
    finally:
        front.stop()


def _wait_http_ready(http: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"the serving container exited ({proc.returncode}) before it was ready:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as resp:  # noqa: S310
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise ServerError(f"the serving container was not ready after {timeout_s:.0f} s:\n{tail(log)}")


@contextlib.contextmanager
def openai_endpoint(repo: Path, state_dir: Path, log_dir: Path, gpu_here: bool, triton_model: str = "ensemble",
                    timeout_s: float = 600, note: Callable[[str], None] = lambda _: None,
                    engine: Optional[str] = None, exe: Optional[str] = None) -> Iterator[Endpoint]:
    """An OpenAI endpoint serving ``repo`` for the duration of the block (see the module docstring). ``engine`` /
    ``exe``: the container engine the build's jobs ran in, which serves a repository that needs its container."""
    repo = Path(repo)
    info = repository_info(repo)
    name = info.get("recipe") or repo.name
    if (repo / "tensorrt_llm" / "1" / "model.yaml").is_file():
        raise InputError(f"{repo} is a target pytorch (llmapi) repository: its OpenAI endpoint is trtllm-serve "
                         "(deploy/<recipe>/trtllm-serve/serve.sh), which the task gate does not start yet; run "
                         "the task gate on the reference or tensorrt target, or leave evaluation.tasks empty")
    reused = running_endpoint(repo, state_dir)
    if reused is not None:
        note(f"{name}: {reused.how}")
        yield reused
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    container = info.get("container")
    if not container:  # the CPU reference runtime: a real tritonserver here
        cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                           log_file=log_dir / f"{name}-tritonserver.log")
        with TritonServer(cfg) as server:
            with _front(repo, server.urls()["grpc"], triton_model) as url:
                note(f"{name}: tritonserver here (CPU reference runtime, a test and development vehicle), {url}")
                yield Endpoint(url=url, model=name, how="tritonserver here (CPU reference runtime)")
        return
    if not gpu_here:
        raise InputError(f"{name} is served by the engine in {container} on an NVIDIA GPU, and this machine has "
                         "none: run the task gate on a GPU host (kiln build RECIPE there), or build here with "
                         "--to package and leave the gate to the GPU host")
    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    engine, exe = serving_engine(engine, exe)
    cmd = docker_command(repo, info, cfg, engine=engine, exe=exe)
    log = log_dir / f"{name}-container.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        try:
            _wait_http_ready(f"{cfg.host}:{cfg.http_port}", proc, log, timeout_s)
            with _front(repo, f"{cfg.host}:{cfg.grpc_port}", triton_model) as url:
                note(f"{name}: {container} ({engine}, GPU), {url}")
                yield Endpoint(url=url, model=name, how=f"{container} ({engine}, GPU)")
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
