"""A real OCI registry for tests and benchmarks: Debian's ``docker-registry`` (the CNCF distribution registry)
on 127.0.0.1, storage in a temporary directory, optionally behind htpasswd authentication.

``.ci/run`` installs it (apt ``docker-registry``); where the binary is absent, :func:`registry_binary` says so and
callers skip with that reason.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urljoin

import requests

BINARY = "docker-registry"


def registry_binary() -> Optional[str]:
    return shutil.which(BINARY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def htpasswd_line(user: str, password: str) -> str:
    """A bcrypt htpasswd entry (what distribution's htpasswd auth accepts), made with the bcrypt package."""
    import bcrypt

    return f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}\n"


@dataclass
class LocalRegistry:
    root: Path
    port: int
    proc: Optional[subprocess.Popen] = None
    auth: Optional[tuple[str, str]] = None
    log: Path = field(init=False)

    def __post_init__(self):
        self.log = self.root / "registry.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, repository: str = "kiln-cache") -> str:
        return f"oci+http://{self.host}/{repository}"

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    def start(self, timeout: float = 30) -> "LocalRegistry":
        config = self.root / "config.yml"
        auth = ""
        if self.auth is not None:
            (self.root / "htpasswd").write_text(htpasswd_line(*self.auth))
            auth = f"auth:\n  htpasswd:\n    realm: kiln-test\n    path: {self.root / 'htpasswd'}\n"
        config.write_text(
            "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n" + auth)
        self.proc = subprocess.Popen([registry_binary() or BINARY, "serve", str(config)],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = requests.get(f"http://{self.host}/v2/", timeout=1)
                if r.status_code in (200, 401):
                    return self
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError("docker-registry did not answer in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def blob_path(self, digest: str) -> Path:
        algo, hexd = digest.split(":", 1)
        return self.storage / "docker" / "registry" / "v2" / "blobs" / algo / hexd[:2] / hexd / "data"


def start_registry(root: Path, auth: Optional[tuple[str, str]] = None, port: Optional[int] = None) -> LocalRegistry:
    root.mkdir(parents=True, exist_ok=True)
    return LocalRegistry(root, port or free_port(), auth=auth).start()


class CountingProxy:
    """A TCP relay 127.0.0.1:port → the registry that counts the bytes each way (``up``: client → registry,
    ``down``: registry → client) and can stop relaying after a number of bytes one way (the connection then
    hangs, as a network that died mid-transfer would, until the client is killed)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.counts = {"up": 0, "down": 0}
        self.stall: dict[str, Optional[int]] = {"up": None, "down": None}
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, repository: str) -> str:
        return f"oci+http://{self.host}/{repository}"

    @property
    def up(self) -> int:
        return self.counts["up"]

    @property
    def down(self) -> int:
        return self.counts["down"]

    def reset(self, stall_up_after: Optional[int] = None, stall_down_after: Optional[int] = None) -> None:
        with self._lock:
            self.counts = {"up": 0, "down": 0}
            self.stall = {"up": stall_up_after, "down": stall_down_after}

    def stalled(self, direction: str) -> bool:
        limit = self.stall[direction]
        return limit is not None and self.counts[direction] >= limit

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "down"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                with self._lock:
                    limit = self.stall[direction]
                    if limit is not None and self.counts[direction] + len(data) > limit:
                        data = data[:max(0, limit - self.counts[direction])]
                        hang = True
                    else:
                        hang = False
                    self.counts[direction] += len(data)
                if data:
                    dst.sendall(data)
                if hang:
                    while not self._stop.is_set():
                        time.sleep(0.05)
                    return
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._server.close()


_RAW = requests.Session()


def raw_push(host: str, repository: str, tag: str, manifest: bytes, blobs: list[bytes]) -> requests.Response:
    """Push ``blobs`` and then ``manifest`` under ``tag`` with plain OCI distribution requests (no kiln code): how
    a hostile or foreign client would write an entry. Returns the manifest PUT's response (201 when stored)."""
    base = f"http://{host}/v2/{repository}"
    for blob in blobs:
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        if _RAW.head(f"{base}/blobs/{digest}", timeout=10).status_code == 200:
            continue
        start = _RAW.post(f"{base}/blobs/uploads/", timeout=10)
        start.raise_for_status()
        location = urljoin(start.url, start.headers["Location"])
        sep = "&" if "?" in location else "?"
        _RAW.put(f"{location}{sep}digest={digest}", data=blob, timeout=10,
                 headers={"Content-Type": "application/octet-stream"}).raise_for_status()
    return _RAW.put(f"{base}/manifests/{tag}", data=manifest, timeout=10,
                    headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
