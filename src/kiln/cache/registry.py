"""A small client for the OCI distribution API (the HTTP API every OCI registry serves), over ``requests``.

Only what the cache needs: manifests by tag or digest, blobs by digest (existence, streamed download with the
sha256 checked here, streamed monolithic upload), tag listing, deletes. Authentication answers the registry's
``WWW-Authenticate`` challenge: Basic, or Bearer through the registry's token service (with the credentials
from :mod:`kiln.cache.credentials`, or anonymously). No retry loops with long sleeps: a registry that does not
answer is reported at once, so a build can fall back to working locally.

Why not oras-py for this: its requests retry five times with sleeps of up to 83 s on a refused connection, its
monolithic upload reads a whole blob into memory, it re-sends a body after a 401 from a consumed file, and it
neither reports progress nor checks a downloaded blob's digest.
"""

from __future__ import annotations

import base64
import hashlib
import queue
import re
import threading
from typing import BinaryIO, Callable, Optional
from urllib.parse import urljoin

import requests

from kiln.cache.credentials import Credentials, find_credentials
from kiln.cache.errors import AuthError, BadArtifact, DigestMismatch, RegistryError, UnreachableError
from kiln.cache.reference import CREDENTIALS_HINT, CacheRef

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CHUNK = 1 << 20
MAX_MANIFEST = 4 << 20  # distribution's own limit on a manifest it stores
DOWNLOAD_CHUNK = 4 << 20
TIMEOUT = (10.0, 120.0)  # connect, read (seconds)
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")

Progress = Callable[[int], None]


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _reason(exc: Exception) -> str:
    """A short cause for a connection failure ("Connection refused"), not urllib3's paragraph."""
    text = str(exc)
    found = _ERRNO.search(text)
    if found:
        return found.group(1).strip()
    if isinstance(exc, requests.exceptions.Timeout):
        return "timed out"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return "the connection closed before the whole body arrived"
    return type(exc).__name__


class _Slice:
    """A file range as a request body: read in large blocks, reporting bytes as they are handed to the socket."""

    def __init__(self, fh: BinaryIO, size: int, on_bytes: Optional[Progress]):
        self._fh, self._left, self._on = fh, size, on_bytes

    def __len__(self) -> int:
        return self._left

    def read(self, amt: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        block = self._fh.read(min(self._left, max(amt, CHUNK)))
        self._left -= len(block)
        if self._on is not None and block:
            self._on(len(block))
        return block


class Registry:
    """One repository of one registry (a :class:`CacheRef`)."""

    def __init__(self, ref: CacheRef, credentials: Optional[Credentials] = None, lookup: bool = True):
        self.ref = ref
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "kiln-cache"
        self._credentials = credentials
        self._looked_up = credentials is not None or not lookup
        self._authorization: Optional[str] = None

    # ------------------------------------------------------------------ auth and requests
    @property
    def credentials(self) -> Optional[Credentials]:
        if not self._looked_up:
            self._credentials = find_credentials(self.ref.host)
            self._looked_up = True
        return self._credentials

    def _who(self) -> str:
        c = self.credentials
        return str(c) if c is not None else "anonymous access (no credentials found)"

    def _send(self, method: str, url: str, headers: Optional[dict], body: Optional[Callable[[], object]],
              stream: bool) -> requests.Response:
        h = dict(headers or {})
        if self._authorization:
            h["Authorization"] = self._authorization
        try:
            return self.session.request(method, url, headers=h, data=body() if body else None, stream=stream,
                                        timeout=TIMEOUT)
        except requests.exceptions.SSLError as exc:
            raise UnreachableError(f"TLS failed talking to registry {self.ref.host} ({_reason(exc)}); for a "
                                   "plain-HTTP registry write oci+http://") from None
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise UnreachableError(f"cannot reach registry {self.ref.host}: {_reason(exc)}") from None

    def _authenticate(self, challenge: str) -> None:
        scheme, _, params_text = challenge.partition(" ")
        params = dict(_CHALLENGE_PARAM.findall(params_text))
        creds = self.credentials
        if scheme.lower() == "basic":
            if creds is None or creds.identity_token:
                raise AuthError(f"registry {self.ref.host} needs credentials and none were found: {CREDENTIALS_HINT}")
            token = base64.b64encode(f"{creds.username}:{creds.secret}".encode()).decode()
            self._authorization = f"Basic {token}"
            return
        if scheme.lower() != "bearer" or "realm" not in params:
            raise AuthError(f"registry {self.ref.host} asks for an authentication kiln does not speak "
                            f"({scheme or 'none'})")
        query = {k: params[k] for k in ("service", "scope") if k in params}
        try:
            if creds is not None and creds.identity_token:
                r = self.session.post(params["realm"], data={**query, "grant_type": "refresh_token",
                                                             "refresh_token": creds.secret, "client_id": "kiln"},
                                      timeout=TIMEOUT)
            else:
                auth = (creds.username, creds.secret) if creds is not None else None
                r = self.session.get(params["realm"], params=query, auth=auth, timeout=TIMEOUT)
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
            raise UnreachableError(f"cannot reach the token service of registry {self.ref.host}: "
                                   f"{_reason(exc)}") from None
        if r.status_code in (401, 403):
            raise AuthError(f"registry {self.ref.host}'s token service refused {self._who()} "
                            f"(HTTP {r.status_code}): {CREDENTIALS_HINT}")
        try:
            data = r.json()
            token = data.get("token") or data.get("access_token")
        except ValueError:
            token = None
        if r.status_code != 200 or not token:
            raise AuthError(f"registry {self.ref.host}'s token service gave no token (HTTP {r.status_code})")
        self._authorization = f"Bearer {token}"

    def request(self, method: str, url: str, ok: tuple[int, ...], what: str, headers: Optional[dict] = None,
                body: Optional[Callable[[], object]] = None, stream: bool = False) -> requests.Response:
        """Send a request, answering an authentication challenge once; RegistryError unless the status is in
        ``ok``. ``body`` makes the request body (called again if the request has to be re-sent)."""
        r = self._send(method, url, headers, body, stream)
        if r.status_code == 401:
            challenge = r.headers.get("WWW-Authenticate", "")
            r.close()
            self._authenticate(challenge)
            r = self._send(method, url, headers, body, stream)
            if r.status_code == 401:
                r.close()
                raise AuthError(f"registry {self.ref.host} refused {self._who()} (HTTP 401): {CREDENTIALS_HINT}")
        if r.status_code == 403:
            r.close()
            raise AuthError(f"registry {self.ref.host}: {self._who()} may not {what} {self.ref.repository} "
                            "(HTTP 403): ask for push/pull access to that repository")
        if r.status_code not in ok:
            detail = _oci_errors(r)
            r.close()
            raise RegistryError(f"registry {self.ref.host}: could not {what} {self.ref.repository}: "
                                f"HTTP {r.status_code}{detail}")
        return r

    # ------------------------------------------------------------------ API
    def ping(self) -> None:
        self.request("GET", f"{self.ref.scheme}://{self.ref.host}/v2/", (200,), "reach").close()

    def get_manifest(self, reference: str) -> Optional[tuple[bytes, str]]:
        """A manifest's bytes and digest by tag or digest; None when there is none. The bytes are checked
        against the digest the registry names (and against ``reference`` when it is a digest); one larger than
        :data:`MAX_MANIFEST` is refused (BadArtifact) without reading more of it."""
        r = self.request("GET", f"{self.ref.base}/manifests/{reference}", (200, 404), "read a manifest from",
                         headers={"Accept": OCI_MANIFEST}, stream=True)
        if r.status_code == 404:
            r.close()
            return None
        data = bytearray()
        too_big = BadArtifact(f"registry {self.ref.host}: manifest {reference} is larger than {MAX_MANIFEST} bytes, "
                              "more than any kiln entry or the registry's own limit (refused)")
        try:
            length = r.headers.get("Content-Length", "")
            if length.isdigit() and int(length) > MAX_MANIFEST:
                raise too_big
            for chunk in r.iter_content(CHUNK):
                data += chunk
                if len(data) > MAX_MANIFEST:
                    raise too_big
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                requests.exceptions.ChunkedEncodingError) as exc:
            raise UnreachableError(f"registry {self.ref.host}: reading manifest {reference} broke off: "
                                   f"{_reason(exc)}") from None
        finally:
            r.close()
        body = bytes(data)
        digest = sha256_digest(body)
        claimed = r.headers.get("Docker-Content-Digest") or (reference if reference.startswith("sha256:") else None)
        if claimed and claimed != digest:
            raise DigestMismatch(f"registry {self.ref.host}: manifest {reference} hashes to {digest}, not "
                                 f"{claimed}", claimed)
        return body, digest

    def put_manifest(self, tag: str, body: bytes) -> str:
        r = self.request("PUT", f"{self.ref.base}/manifests/{tag}", (201,), "push a manifest to",
                         headers={"Content-Type": OCI_MANIFEST}, body=lambda: body)
        r.close()
        return sha256_digest(body)

    def delete_manifest(self, digest: str) -> None:
        self._delete(f"{self.ref.base}/manifests/{digest}", "delete a manifest in")

    def delete_blob(self, digest: str) -> None:
        self._delete(f"{self.ref.base}/blobs/{digest}", "delete a blob in")

    def _delete(self, url: str, what: str) -> None:
        try:
            self.request("DELETE", url, (202, 200), what).close()
        except RegistryError as exc:
            if "HTTP 405" in str(exc):
                raise RegistryError(f"{exc} — the registry does not allow deletes (distribution: "
                                    "storage.delete.enabled: true)") from None
            raise

    def tags(self) -> list[str]:
        """Every tag of the repository (all pages); [] when the repository does not exist yet."""
        out: list[str] = []
        url: Optional[str] = f"{self.ref.base}/tags/list?n=1000"
        while url:
            r = self.request("GET", url, (200, 404), "list the tags of")
            if r.status_code == 404:
                r.close()
                return out
            out += list(r.json().get("tags") or [])
            link = r.headers.get("Link", "")
            found = re.search(r"<([^>]+)>\s*;\s*rel=\"?next\"?", link)
            url = urljoin(url, found.group(1)) if found else None
        return out

    def blob_exists(self, digest: str) -> bool:
        r = self.request("HEAD", f"{self.ref.base}/blobs/{digest}", (200, 404), "look up a blob in")
        r.close()
        return r.status_code == 200

    def put_blob(self, digest: str, size: int, open_body: Callable[[], BinaryIO],
                 on_bytes: Optional[Progress] = None) -> None:
        """Upload one blob: start an upload session, then one streamed PUT with the digest (the registry checks
        it). ``open_body`` returns a file positioned at the blob's first byte."""
        r = self.request("POST", f"{self.ref.base}/blobs/uploads/", (202,), "start an upload to")
        r.close()
        location = r.headers.get("Location")
        if not location:
            raise RegistryError(f"registry {self.ref.host} started an upload without a Location")
        url = urljoin(r.url, location)
        url += ("&" if "?" in url else "?") + f"digest={digest}"
        self.request("PUT", url, (201,), "upload a blob to",
                     headers={"Content-Type": "application/octet-stream"},
                     body=lambda: _Slice(open_body(), size, on_bytes)).close()

    def fetch_blob(self, digest: str, size: int, sink: BinaryIO, on_bytes: Optional[Progress] = None) -> None:
        """Stream a blob into ``sink``, hashing it here: DigestMismatch unless its bytes are ``digest``. The socket
        is read on this thread while another writes and hashes (both release the GIL), so verification costs
        little throughput."""
        if not digest.startswith("sha256:"):
            raise RegistryError(f"blob {digest}: kiln verifies sha256 digests only")
        r = self.request("GET", f"{self.ref.base}/blobs/{digest}", (200,), "download a blob from", stream=True)
        worker = _HashingWriter(sink, on_bytes)
        try:
            for chunk in r.iter_content(DOWNLOAD_CHUNK):
                worker.put(chunk)
                if worker.received > size:
                    break
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                requests.exceptions.ChunkedEncodingError) as exc:  # the last: the body ended short
            worker.close()
            raise UnreachableError(f"registry {self.ref.host}: download of {digest} broke off: {_reason(exc)}") \
                from None
        finally:
            r.close()
        n, got = worker.close()
        if n != size or got != digest:
            raise DigestMismatch(f"registry {self.ref.host}: blob {digest} is corrupt ({n} bytes hashing to "
                                 f"{got}, expected {size} bytes)", digest)


class _HashingWriter:
    """Writes chunks on one thread and hashes them on another, each fed through a small bounded queue: with the
    socket read on the caller's thread, receiving, writing and hashing overlap (each releases the GIL)."""

    def __init__(self, sink: BinaryIO, on_bytes: Optional[Progress]):
        self._sink, self._on = sink, on_bytes
        self._hash = hashlib.sha256()
        self._written = 0
        self._error: Optional[BaseException] = None
        self.received = 0
        self._queues = (queue.Queue(maxsize=4), queue.Queue(maxsize=4))
        self._threads = (threading.Thread(target=self._run, args=(self._queues[0], self._write), daemon=True),
                         threading.Thread(target=self._run, args=(self._queues[1], self._hash.update), daemon=True))
        for t in self._threads:
            t.start()

    def _write(self, chunk: bytes) -> None:
        self._sink.write(chunk)
        self._written += len(chunk)
        if self._on is not None:
            self._on(len(chunk))

    def _run(self, q: queue.Queue, work: Callable[[bytes], object]) -> None:
        while True:
            chunk = q.get()
            if chunk is None:
                return
            if self._error is None:
                try:
                    work(chunk)
                except BaseException as exc:  # re-raised on the caller's thread
                    self._error = exc

    def put(self, chunk: bytes) -> None:
        if self._error is not None:
            raise self._error
        self.received += len(chunk)
        for q in self._queues:
            q.put(chunk)

    def close(self) -> tuple[int, str]:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        if self._error is not None:
            raise self._error
        return self._written, "sha256:" + self._hash.hexdigest()


def _oci_errors(r: requests.Response) -> str:
    try:
        errors = r.json().get("errors") or []
    except ValueError:
        return ""
    text = "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}" for e in errors if isinstance(e, dict))
    return f" ({text})" if text else ""
