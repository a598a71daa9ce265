"""`kiln serve` sessions: run a server in the foreground until a signal, or detached in the background with a
state file that `kiln stop` uses; and the `--docker` command for the NGC serving container."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from kiln.serve.openai import OpenAIConfig, OpenAIServer
from kiln.serve.server import ServerConfig, ServerError, TritonServer, tail
from kiln.util.errors import InputError, KilnError

STATE_DIR = Path("build") / ".serve"


def state_file_for(repo: Path, state_dir: Path = STATE_DIR) -> Path:
    return state_dir / f"{Path(repo).resolve().name}.json"


def _write_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class ServingRecord:
    """Where a packaged repository is served: kiln.json's ``serving`` record (the recipe's serving.host, the HTTP,
    gRPC, metrics and OpenAI ports, and the Triton model the OpenAI server calls), and, while a `kiln serve` of it
    runs, that session's state (its pid and URLs, which command-line overrides may have changed)."""

    repo: Path
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    openai_port: int
    openai_model: str
    recorded: bool  # False: kiln.json has no serving record (packaged by an older kiln, or by hand): schema defaults
    running: Optional[dict] = None  # the running `kiln serve`'s state file content (pid, urls, log), if any

    def urls(self) -> dict[str, str]:
        """The running session's URLs, else the recorded ones (``grpc`` is host:port, tritonclient's form)."""
        if self.running and self.running.get("urls"):
            return dict(self.running["urls"])
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return {"http": f"http://{host}:{self.http_port}", "grpc": f"{host}:{self.grpc_port}",
                "metrics": f"http://{host}:{self.metrics_port}/metrics", "openai": f"http://{host}:{self.openai_port}/v1"}


def serving_record(repo: Path, state_dir: Path = STATE_DIR) -> ServingRecord:
    """The one reader of kiln.json's serving record (`kiln serve REPO` serves there; the clients default to it).
    A repository without the record gets the schema's defaults (``recorded`` False); a malformed one is refused
    with the file and key."""
    from kiln.recipe.schema import ServingSection

    repo = Path(repo)
    info_file = repo / "kiln.json"
    try:
        info = json.loads(info_file.read_text(encoding="utf-8")) if info_file.is_file() else {}
    except ValueError as exc:
        raise InputError(f"{info_file}: not JSON ({exc}); package the recipe again") from None
    record = info.get("serving")
    defaults = ServingSection()
    values = {}
    for key in ("host", "http_port", "grpc_port", "metrics_port", "openai_port", "openai_model"):
        value = (record or {}).get(key, getattr(defaults, key))
        want = str if key in ("host", "openai_model") else int
        if not isinstance(value, want) or isinstance(value, bool) or (want is int and not 1 <= value <= 65_535):
            raise InputError(f"{info_file}: serving.{key} is {value!r}, not a {'port' if want is int else 'string'}; "
                             "package the recipe again (kiln build) to rewrite the record")
        values[key] = value
    running = None
    state_file = state_file_for(repo, state_dir)
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text())
        except ValueError:
            state = {}
        if _alive(state.get("pid")) and state.get("repo") == str(repo.resolve()):
            running = state
    return ServingRecord(repo=repo, recorded=isinstance(record, dict), running=running, **values)


def serve_foreground(cfg: ServerConfig, announce: Callable[[dict], None], state_file: Optional[Path] = None,
                     timeout_s: float = 300, openai: Optional[OpenAIConfig] = None) -> int:
    """Start the server (and, with ``openai``, kiln's OpenAI-compatible server in front of it: its
    ``triton_url`` is filled in), announce the endpoints, serve until SIGINT/SIGTERM or until it dies.

    Returns 0 after a clean stop; raises ServerError (with the log's tail) when it fails to start or dies.
    """
    stop = {"requested": False}

    def on_signal(signum, _frame):  # noqa: ANN001
        stop["requested"] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    server = TritonServer(cfg)
    front: Optional[OpenAIServer] = None
    try:
        server.start(timeout_s=timeout_s)
        urls = server.urls()
        if openai is not None:
            front = OpenAIServer(dataclasses.replace(openai, triton_url=urls["grpc"]))
            front.start()
            urls["openai"] = f"{front.cfg.url}/v1"
        state = {"pid": os.getpid(), "repo": str(Path(cfg.repo).resolve()), "urls": urls,
                 "log": str(server.log_file), "startup_s": server.startup_s, "ready": True}
        if state_file is not None:
            _write_state(state_file, state)
        announce(state)
        while not stop["requested"]:
            if not server.is_running():
                raise ServerError(f"tritonserver stopped unexpectedly.\n--- last lines of {server.log_file} ---\n"
                                  f"{server.log_tail()}")
            time.sleep(0.3)
        return 0
    finally:
        if front is not None:
            front.stop()
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if state_file is not None:
            state_file.unlink(missing_ok=True)


def start_background(argv: list[str], state_file: Path, log_file: Path, timeout_s: float = 300) -> dict:
    """Run `argv` (a foreground `kiln serve … --state-file`) detached; return its state once ready."""
    if state_file.exists():
        old = json.loads(state_file.read_text())
        if _alive(old.get("pid")):
            raise InputError(f"a kiln server for this repository is already running (pid {old['pid']}, "
                             f"{old.get('urls', {}).get('http')}); stop it with `kiln stop`")
        state_file.unlink()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if state_file.exists():
            return json.loads(state_file.read_text())
        if proc.poll() is not None:
            raise ServerError(f"the background server exited with code {proc.returncode} before it was ready.\n"
                              f"--- last lines of {log_file} ---\n{tail(log_file)}")
        time.sleep(0.3)
    proc.terminate()
    raise ServerError(f"the background server was not ready within {timeout_s:.0f}s; log: {log_file}")


def _alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(state_dir: Path = STATE_DIR) -> list[tuple[Path, dict]]:
    out = []
    for f in sorted(state_dir.glob("*.json")) if state_dir.is_dir() else []:
        try:
            out.append((f, json.loads(f.read_text())))
        except ValueError:
            continue
    return out


def serving_urls(repo: Optional[Path] = None, state_dir: Path = STATE_DIR) -> Optional[dict]:
    """Where the running ``kiln serve`` answers (its state file's ``urls``: http, grpc, metrics, openai when on):
    REPO's when given (an error when none runs for it), else the only one running; None when none runs (the
    caller falls back to the schema's default ports)."""
    if repo is not None:
        record = serving_record(repo, state_dir)  # the one reader of a repository's serving record and session
        if record.running is None:
            raise InputError(f"--serving {repo}: no kiln serve is running for it (start one: kiln serve {repo} "
                             "--background)")
        return record.urls()
    live = [(f, state) for f, state in running(state_dir) if _alive(state.get("pid"))]
    if len(live) > 1:
        raise InputError("several kiln serve are running (" + ", ".join(str(st.get("repo")) for _, st in live) +
                         "): pick one with --serving REPO")
    return live[0][1].get("urls") if live else None


def stop_background(state_file: Path, timeout_s: float = 30) -> bool:
    """SIGTERM the background `kiln serve` (it stops its server and cleans up); SIGKILL its group if it hangs.
    Returns False when nothing was running."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return False
    pid = state.get("pid")
    if not _alive(pid):
        state_file.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    state_file.unlink(missing_ok=True)
    return True


SERVE_ENGINES = ("docker", "podman")
"""Container engines that can serve a repository: each publishes the server's ports on the host."""


def serving_engine(preferred: Optional[str] = None, exe: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(engine, executable) that serves a repository: ``preferred`` (the engine the build's jobs ran in) when it
    is docker or podman, else the first of them on PATH, else docker (whose command then says it is missing)."""
    if preferred in SERVE_ENGINES:
        return preferred, exe or shutil.which(preferred)
    for name in SERVE_ENGINES:
        found = shutil.which(name)
        if found:
            return name, found
    return "docker", None


def docker_command(repo: Path, info: dict, cfg: ServerConfig, engine: str = "docker",
                   exe: Optional[str] = None) -> list[str]:
    """`docker run` (or `podman run`) of the serving container named in the repository's kiln.json (the one that
    built the engine, pinned by digest when known), the repository mounted read-only at /models. Inside, the
    repository's engine check runs first (it refuses an engine built by other TensorRT-LLM/TensorRT versions, with
    the rebuild command), then kiln.json's server command (mpirun leader mode or orchestrator mode included).

    podman gets the GPUs through CDI (``--device nvidia.com/gpu=all``) and no ``--shm-size``, which it refuses
    beside ``--ipc=host``; the command is checked against the engines' documented rules like every job's."""
    from kiln.runtime.engine_runtime import argv_problems, gpu_flags, ulimit_flags

    image = info.get("container")
    if not image:
        raise InputError(f"{repo}/kiln.json names no serving container: `--docker` serves tensorrt-target "
                         "repositories; serve the reference target without --docker")
    stacks = info.get("stacks")
    needed = "triton-llmapi" if info.get("layout") == "llmapi" else "triton-tensorrtllm"
    if stacks is not None and needed not in stacks and any(s.startswith("triton-") for s in stacks):
        raise InputError(f"{image} carries no {needed} stack ({', '.join(stacks)}): package the recipe for a serving "
                         "image that has it (kiln's container table, src/kiln/recipe/data/trtllm_containers.json)")
    if stacks is not None and needed not in stacks:
        name = info.get("recipe") or "<recipe>"
        raise InputError(f"{image} carries no Triton server (TensorRT-LLM {info.get('serving_tensorrt_llm')}: "
                         f"{', '.join(stacks)} only; no Triton image ships TensorRT-LLM after 1.2.1). Serve "
                         f"{repo} with deploy/{name}/trtllm-serve/serve.sh or deploy/{name}/dynamo/launch.sh on a "
                         "GPU host, or package the recipe with --set engine_runtime.trtllm_version=1.2.1 for a Triton "
                         "repository")
    if engine not in SERVE_ENGINES:
        raise InputError(f"the serving container runs with docker or podman, not {engine}: publish the server's "
                         "ports with one of them, or run deploy/<recipe>/launch.sh on a GPU host")
    if exe is None and shutil.which(engine) is None:
        raise InputError(f"{engine} is not installed here; serve without --docker, or run deploy/<recipe>/launch.sh "
                         "on a GPU host")
    server = list(info.get("server_command") or [])
    if not server:
        raise InputError(f"{repo}/kiln.json has no server_command: package the recipe again with this kiln")
    check = list(info.get("check_command") or [])
    container_ports = {flag: int(arg.split("=", 1)[1]) for arg in server for flag in ("--http-port", "--grpc-port",
                                                                                       "--metrics-port")
                       if arg.startswith(flag + "=")}
    host_ports = {"--http-port": cfg.http_port, "--grpc-port": cfg.grpc_port, "--metrics-port": cfg.metrics_port}
    ports = [f"-p{cfg.host}:{host_ports[flag]}:{port}" for flag, port in container_ports.items()]
    inner = (shlex.join(check) + " && " if check else "") + "exec " + shlex.join(server)
    shm = [] if engine == "podman" else ["--shm-size=4g"]  # podman refuses it beside --ipc=host
    argv = [exe or engine, "run", "--rm", *gpu_flags(engine), "--ipc=host", *shm, *ulimit_flags(), *ports,
            "-v", f"{Path(repo).resolve()}:/models:ro", image, "bash", "-c", inner]
    problems = argv_problems(engine, argv, rootless=True, host_env=os.environ)
    if problems:
        raise KilnError("kiln generated a serving command the container engine refuses (a bug in kiln):\n  - "
                        + "\n  - ".join(problems) + "\n$ " + shlex.join(argv))
    return argv


def check_engine_here(repo: Path, info: dict) -> None:
    """Refuse to serve a tensorrt repository with a local tritonserver whose TensorRT-LLM/TensorRT are not the
    ones that built the engine (the same check launch.sh runs in the container)."""
    from kiln.runtime.workers.check_engine import installed, message, mismatches

    found = installed()
    problems = mismatches(info, found)
    if problems:
        raise InputError(message(info, found, problems))


def run_docker(cmd: list[str]) -> int:
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 0
