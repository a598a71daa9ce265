"""Start and stop a Dynamo frontend and kiln's CPU worker(s) (a TEST AND DEVELOPMENT VEHICLE on the CPU; see the
package docstring). Discovery is a folder (``DYN_FILE_KV``), requests go over TCP, every address is 127.0.0.1."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import requests

#: The Dynamo release the Makefile installs (PyPI's newest): the CPU tests' frontend and runtime.
DYNAMO_VERSION = "1.6.1"
LOOPBACK = "127.0.0.1"


def dynamo_available() -> Optional[str]:
    """None when ``dynamo.frontend`` and ``dynamo.llm`` import here, else why not (with the install command)."""
    missing = [m for m in ("dynamo.frontend", "dynamo.llm", "dynamo.runtime") if _find(m) is None]
    if missing:
        return (f"NVIDIA Dynamo is not installed in this environment ({', '.join(missing)} missing): `make install` "
                f"installs ai-dynamo/ai-dynamo-runtime {DYNAMO_VERSION} (see the Makefile)")
    return None


def _find(module: str):
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None


def dynamo_env(discovery_dir: Path, base: Optional[dict] = None) -> dict[str, str]:
    """The environment of every Dynamo process here: file discovery in ``discovery_dir``, the TCP request plane,
    every endpoint advertised on loopback (no etcd, no NATS)."""
    env = dict(os.environ if base is None else base)
    env.update({"DYN_FILE_KV": str(discovery_dir), "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp",
                "DYN_TCP_RPC_HOST": LOOPBACK, "DYN_EVENT_PLANE_HOST": LOOPBACK, "DYN_SYSTEM_HOST": LOOPBACK,
                "PYTHONUNBUFFERED": "1"})
    return env


def frontend_command(http_port: int, router_mode: str = "round-robin") -> list[str]:
    return [sys.executable, "-m", "dynamo.frontend", "--discovery-backend", "file", "--request-plane", "tcp",
            "--http-host", LOOPBACK, "--http-port", str(http_port), "--router-mode", router_mode]


def worker_command(model_dir: Path, served_model_name: str, llm_args: Optional[Path] = None,
                   num_threads: int = 1, chat_template: Optional[Path] = None) -> list[str]:
    cmd = [sys.executable, "-m", "kiln.serve.dynamo.worker", "--model-dir", str(model_dir), "--served-model-name",
           served_model_name, "--discovery-backend", "file", "--request-plane", "tcp", "--num-threads",
           str(num_threads)]
    cmd += ["--llm-args", str(llm_args)] if llm_args else []
    return cmd + (["--chat-template", str(chat_template)] if chat_template else [])


@dataclass
class DynamoStack:
    """A Dynamo frontend on ``http_port`` and ``workers`` kiln CPU workers serving ``model_dir`` as
    ``served_model_name``. ``with DynamoStack(...) as stack:`` starts them and waits until the frontend lists the
    model; leaving stops them (SIGTERM, then SIGKILL)."""

    model_dir: Path
    served_model_name: str
    http_port: int
    workers: int = 1
    llm_args: Optional[Path] = None
    chat_template: Optional[Path] = None
    log_dir: Optional[Path] = None
    discovery_dir: Optional[Path] = None
    startup_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0                #: SIGTERM, then SIGKILL for what is still running after this
    procs: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    def log_path(self, name: str) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"{name}.log"

    def start(self) -> "DynamoStack":
        why = dynamo_available()
        if why:
            raise RuntimeError(why)
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="kiln-dynamo-logs-"))
        if self.discovery_dir is None:
            self.discovery_dir = Path(tempfile.mkdtemp(prefix="kiln-dynamo-kv-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dynamo_env(self.discovery_dir)
        self._spawn("frontend", frontend_command(self.http_port), env)
        for i in range(self.workers):
            self._spawn(f"worker{i}", worker_command(self.model_dir, self.served_model_name, self.llm_args,
                                                     chat_template=self.chat_template), env)
        self.wait_ready()
        return self

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        log = open(self.log_path(name), "ab")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append((name, proc))

    def wait_ready(self) -> None:
        """Until ``/v1/models`` lists the model and every worker said it is ready (each registered)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"Dynamo {name} exited with {proc.returncode} while starting; its log "
                                       f"({self.log_path(name)}):\n{self.log_path(name).read_text(errors='replace')[-3000:]}")
            ready = all(b'"kiln_dynamo_worker": "ready"' in self.log_path(n).read_bytes()
                        for n, _ in self.procs if n.startswith("worker"))
            if ready:
                try:
                    r = requests.get(f"{self.base_url}/v1/models", timeout=2)
                    if r.ok and any(m.get("id") == self.served_model_name for m in r.json().get("data", [])):
                        return
                except requests.RequestException:
                    pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"Dynamo did not list {self.served_model_name} within {self.startup_timeout_s:.0f} s "
                           f"(logs in {self.log_dir})")

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self.procs.clear()

    def __enter__(self) -> "DynamoStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stack_for_repository(repo: Path, http_port: int, workers: int = 1,
                         log_dir: Optional[Path] = None) -> DynamoStack:
    """A :class:`DynamoStack` serving a packaged target-pytorch repository (``kiln.json`` layout ``llmapi``): its
    unified checkpoint with its model.yaml's LLM arguments, under the recipe's name."""
    import json

    info_file = Path(repo) / "kiln.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    if info.get("layout") != "llmapi":
        raise ValueError(f"{repo}: --stack dynamo serves target-pytorch repositories (ModelOpt's unified checkpoint); "
                         "this one is not (package the recipe with --set target=pytorch)")
    version = Path(repo) / "tensorrt_llm" / "1"
    template = version / "chat_template.jinja"
    return DynamoStack(model_dir=version / "checkpoint", served_model_name=info.get("recipe") or Path(repo).name,
                       http_port=http_port, workers=workers, llm_args=version / "model.yaml",
                       chat_template=template if template.is_file() else None, log_dir=log_dir)


def serve_foreground(stack: DynamoStack, repo: Path, announce, state_file: Optional[Path] = None) -> int:
    """Start ``stack``, write the state `kiln stop` reads, announce, serve until SIGINT/SIGTERM or until a process
    dies (RuntimeError with its log's tail); always stops every process."""
    import json

    stop = {"requested": False}

    def on_signal(signum, _frame):  # noqa: ANN001
        stop["requested"] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    started = time.monotonic()
    try:
        stack.start()
        state = {"pid": os.getpid(), "repo": str(Path(repo).resolve()), "stack": "dynamo",
                 "urls": {"http": stack.base_url, "openai": f"{stack.base_url}/v1"},
                 "log": str(stack.log_dir), "startup_s": time.monotonic() - started, "ready": True,
                 "processes": {name: proc.pid for name, proc in stack.procs}}
        if state_file is not None:
            state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = state_file.with_suffix(".part")
            tmp.write_text(json.dumps(state, indent=2))
            os.replace(tmp, state_file)
        announce(state)
        while not stop["requested"]:
            for name, proc in stack.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"Dynamo {name} stopped unexpectedly (exit {proc.returncode}); log "
                                       f"{stack.log_path(name)}:\n"
                                       f"{stack.log_path(name).read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        return 0
    finally:
        stack.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if state_file is not None:
            state_file.unlink(missing_ok=True)
