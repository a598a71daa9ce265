"""Start and stop a real ``tritonserver`` for a model repository.

The server is either the ``tritonserver`` found on ``PATH`` (a Triton container or a native install, which
brings its own backends) or the one bundled in the ``nvidia-pytriton`` wheel (``pip install kiln[serve]``).
The wheel ships the server, the Python backend and one backend stub per Python minor version; they are laid
out here as a backend directory (``<dir>/python/{libtriton_python.so, triton_python_backend_utils.py,
triton_python_backend_stub}``) in kiln's cache, once per wheel version and interpreter.

The Python backend stub embeds libpython and finds its site-packages through the ``python3`` on ``PATH``, so
the server runs with this interpreter's ``LIBDIR`` first in ``LD_LIBRARY_PATH`` and its ``bin`` first in
``PATH``: the Python models then run in the same environment as kiln.

Example::

    cfg = ServerConfig(repo=Path("build/triton"), http_port=free_port(), grpc_port=free_port(),
                       metrics_port=free_port())
    with TritonServer(cfg) as server:
        print(server.urls()["http"])
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kiln.util.errors import InputError, KilnError
from kiln.util.paths import cache_root

#: Prefix of the shared-memory regions the Python backend creates in /dev/shm.
SHM_PREFIX = "triton_python_backend_shm_region_"
#: How many lines of the server log an error message carries.
LOG_TAIL_LINES = 60
SHM_DIR = Path("/dev/shm")
#: Seconds tritonserver waits for in-flight requests and open connections after SIGTERM.
EXIT_TIMEOUT_S = 5
#: Log lines after which the server will never become ready, although the process may linger for a while.
FATAL_LOG_MARKERS = ("error while loading shared libraries", "Failed to initialize Python stub")


class ServerError(KilnError):
    """The Triton server could not be found, started or stopped; the message carries the log's tail."""


@dataclass
class ServerConfig:
    """Where the repository is and where the server listens.

    Attributes:
        repo: The Triton model repository (one folder per model, each with a ``config.pbtxt``).
        host: Address all three endpoints bind to. The default keeps the server private to this machine.
        http_port: HTTP/REST port (KServe v2 + the generate extension).
        grpc_port: gRPC port (streaming clients).
        metrics_port: Prometheus metrics port.
        log_file: Where the server's stdout and stderr go; a temporary file when unset.
        extra_args: More ``tritonserver`` flags, appended last (they win over kiln's).
    """

    repo: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_file: Path | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _pytriton_root() -> Path | None:
    """The ``pytriton/tritonserver`` folder of the installed nvidia-pytriton wheel, without importing pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def find_tritonserver() -> Path:
    """The ``tritonserver`` binary: the one on ``PATH`` if any, else the one bundled with nvidia-pytriton.

    Raises:
        ServerError: neither exists; the message says how to install one.
    """
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    root = _pytriton_root()
    if root is not None:
        return root / "bin" / "tritonserver"
    raise ServerError(
        "no `tritonserver` found: none on PATH and the nvidia-pytriton wheel (which bundles one) is not "
        "installed. Install it with `pip install kiln[serve]` (or `pip install nvidia-pytriton==0.7.0`), or run "
        "inside a Triton container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3)."
    )


def python_backend_dir(pytriton_root: Path | None = None, cache_dir: Path | None = None) -> Path:
    """Lay out (once) a backend directory holding the wheel's Python backend for this interpreter.

    Returns the folder to pass as ``--backend-directory``. The layout is built in a temporary folder and
    renamed into place, so concurrent callers never see a half-written one.
    """
    root = pytriton_root or _pytriton_root()
    if root is None:
        raise ServerError("nvidia-pytriton is not installed; `pip install kiln[serve]` brings the Python backend")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir()) if root.is_dir() else []
        raise ServerError(
            f"nvidia-pytriton has no Python backend stub for Python {py} (it has {', '.join(have) or 'none'}); "
            "run kiln with one of those Python versions"
        )
    try:
        version = importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    target = (cache_dir or cache_root()) / "triton-backends" / f"pytriton-{version}-py{py}"
    if (target / "python" / "triton_python_backend_stub").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        (tmp / "python").mkdir()
        backend = root / "backends" / "python"
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(backend / name, tmp / "python" / name)
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            if not (target / "python" / "triton_python_backend_stub").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def server_environment(base: dict[str, str] | None = None, lib_dirs: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment for ``tritonserver``: this interpreter's LIBDIR first in LD_LIBRARY_PATH, its bin first in PATH.

    The backend stub embeds libpython (LIBDIR avoids picking up another patch release of it) and locates
    site-packages through the ``python3`` on PATH (the venv's). ``lib_dirs`` follow LIBDIR (the wheel's own
    shared libraries, which the stub no longer finds through its RPATH once copied out of the wheel).
    """
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR")
    bindir = str(Path(sys.executable).parent)
    first = ([libdir] if libdir else []) + list(lib_dirs)
    parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(first + [p for p in parts if p not in first])
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    env["PATH"] = os.pathsep.join([bindir] + [p for p in parts if p != bindir])
    return env


def _check_numpy() -> None:
    """The bundled backend stub is built against numpy 1.x: refuse early rather than fail on the first request."""
    try:
        version = importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return
    if int(version.split(".")[0]) >= 2:
        raise ServerError(
            f"numpy {version} is installed, but the Triton Python backend stub needs numpy<2 (under numpy 2 every "
            "string input kills the stub). Run `pip install 'numpy<2'` in this environment."
        )


#: Run by a fresh interpreter (no threads, nothing forked from kiln's state) before it execs the server: asks Linux
#: to SIGTERM the process when the thread that started it dies, then becomes the server (same pid).
#: Its first argument is the starter's pid: a starter that died before the flag was set is noticed, not outlived.
_PDEATHSIG_EXEC = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
                   "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` arranged so Linux SIGTERMs it when the thread that starts it dies (no orphaned servers).

    Where util-linux's ``setpriv`` is on PATH the command is prefixed with ``setpriv --pdeathsig TERM --``; else a
    fresh Python interpreter sets the flag (``prctl(PR_SET_PDEATHSIG)``) and execs it. Either way the server keeps
    the pid Popen returns and **nothing runs in the forked child before exec**: a ``preexec_fn`` did, and in a
    process with other threads (gRPC's, torch's) it killed 1 to 9 children in 1500 before exec (SIGABRT/SIGSEGV:
    gRPC's at-fork handlers and locks held at fork time; benchmarks/fork_safety.py measures it). The signal
    fires when the *thread* that started the child exits, so callers use this from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return cmd
    setpriv = _setpriv_with_pdeathsig(shutil.which("setpriv"))
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *cmd]
    return [sys.executable, "-c", _PDEATHSIG_EXEC, str(os.getpid()), *cmd]


@functools.lru_cache(maxsize=None)
def _setpriv_with_pdeathsig(setpriv: str | None) -> str | None:
    """``setpriv`` when it takes ``--pdeathsig`` (util-linux 2.33 and later; RHEL 8's 2.32 does not), tried once."""
    if setpriv is None:
        return None
    try:
        ok = subprocess.run([setpriv, "--pdeathsig", "TERM", "--", "true"], capture_output=True, timeout=10,
                            check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return setpriv if ok else None


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        with path.open("r", errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError:
        return ""


class TritonServer:
    """A ``tritonserver`` process serving one repository; use as a context manager or call start()/stop().

    Each server gets its own Python-backend shared-memory prefix, so stop() can remove exactly the
    ``/dev/shm`` regions it left behind (a killed server does not clean them up).
    """

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.shm_prefix = f"{SHM_PREFIX}kiln_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._own_log: Path | None = None
        self.log_file: Path | None = cfg.log_file
        self.startup_s: float | None = None
        self._cmd: list[str] = []

    # ------------------------------------------------------------------ command line
    def command(self) -> list[str]:
        """The full ``tritonserver`` command line for this configuration."""
        binary = find_tritonserver()
        cfg = self.cfg
        cmd = [
            str(binary),
            f"--model-repository={Path(cfg.repo).resolve()}",
            f"--http-address={cfg.host}",
            f"--http-port={cfg.http_port}",
            f"--grpc-address={cfg.host}",
            f"--grpc-port={cfg.grpc_port}",
            f"--metrics-address={cfg.host}",
            f"--metrics-port={cfg.metrics_port}",
            "--disable-auto-complete-config",
            "--allow-gpu-metrics=false",
            "--exit-on-error=true",
            # On SIGTERM Triton waits for live requests *and open client connections* (an idle keep-alive
            # counts) up to this long; its default of 30 s makes every stop() slow.
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        root = _pytriton_root()
        if root is not None and binary == root / "bin" / "tritonserver":
            cmd.append(f"--backend-directory={python_backend_dir(root)}")
        return cmd + list(cfg.extra_args)

    @staticmethod
    def _lib_dirs() -> tuple[str, ...]:
        """Shared-library folders the bundled server's backend needs (none for a server found on PATH)."""
        root = _pytriton_root()
        if shutil.which("tritonserver") or root is None:
            return ()
        libs = root.parent.parent / "nvidia_pytriton.libs"  # site-packages/nvidia_pytriton.libs
        return (str(libs),) if libs.is_dir() else ()

    def urls(self) -> dict[str, str]:
        """Client addresses: ``http`` and ``metrics`` are URLs, ``grpc`` is ``host:port`` (tritonclient's form)."""
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return {
            "http": f"http://{host}:{self.cfg.http_port}",
            "grpc": f"{host}:{self.cfg.grpc_port}",
            "metrics": f"http://{host}:{self.cfg.metrics_port}/metrics",
        }

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 120) -> None:
        """Start the server and wait until ``/v2/health/ready`` answers 200 (a no-op while it is running).

        Raises:
            InputError: the repository folder does not exist.
            ServerError: no server binary, the process exited (e.g. a model failed to load), or it was not
                ready within ``timeout_s``; the message carries the server log's tail.
        """
        if self.is_running():
            return  # already started (e.g. by ``with``): nothing to do
        repo = Path(self.cfg.repo)
        if not repo.is_dir():
            raise InputError(f"Triton model repository {repo} does not exist (build the package step first)")
        _check_numpy()
        cmd = self.command()
        self._cmd = list(cmd)  # as the user would run it (the starter's die-with-parent wrapper is not theirs)
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix="kiln-tritonserver-", suffix=".log")
            os.close(fd)
            self._own_log = self.log_file = Path(name)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            cmd = die_with_parent(cmd)
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_environment(lib_dirs=self._lib_dirs()),
                start_new_session=True,  # its own process group: stop() can reach the backend stubs too
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_ready(self, timeout_s: float) -> None:
        url = self.urls()["http"] + "/v2/health/ready"
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"tritonserver exited with code {code} before it was ready (a model failed to load?).\n"
                    f"command: {shlex.join(self._cmd)}\n--- last lines of {self.log_file} ---\n"
                    f"{tail(self.log_file)}"  # type: ignore[arg-type]
                )
            log_tail = tail(self.log_file)  # type: ignore[arg-type]
            marker = next((m for m in FATAL_LOG_MARKERS if m in log_tail), None)
            if marker is not None:
                raise ServerError(
                    f"tritonserver could not load a model ({marker!r} in its log).\n"
                    f"--- last lines of {self.log_file} ---\n{log_tail}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(
                    f"tritonserver was not ready within {timeout_s:.0f}s at {url}.\n"
                    f"--- last lines of {self.log_file} ---\n{tail(self.log_file)}"  # type: ignore[arg-type]
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM the server, wait up to ``timeout_s``, SIGKILL its process group if needed, remove its shm files."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self._kill_group(proc)
                    proc.wait(timeout=10)
            # Backend stubs left behind (the server was killed, or crashed) belong to our process group.
            self._kill_group(proc)
            self.proc = None
        for path in glob.glob(str(SHM_DIR / f"{self.shm_prefix}*")):
            try:
                os.unlink(path)
            except OSError:
                pass

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def is_running(self) -> bool:
        """True while the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server log."""
        return tail(self.log_file, lines) if self.log_file else ""

    def __enter__(self) -> TritonServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
