"""Registry credentials never leave the process, on any path: success, 401, 403, a redirect to another origin
(blob storage), a token service that refuses, a transfer that breaks off.

The registry here is a stand-in (named as one: an http.server speaking the OCI distribution API's
authentication — Basic, or a Bearer challenge answered at a token service — as GHCR, Harbor and ECR do), so each
path can be taken on purpose; the real docker-registry's htpasswd path is in test_remote_cache.py. The leak scan
looks for every secret any test sent (the right password, the wrong one, the identity token, the bearer token the
token service issued), raw and encoded (base64 of ``user:secret`` as Basic sends it, base64 of the secret alone,
URL-encoded), in everything that leaves kiln's code: exception messages and their formatted tracebacks, log
records at DEBUG, stdout/stderr, and every request another origin received.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, quote_plus, urlsplit

import pytest

from kiln.cache.credentials import Credentials
from kiln.cache.errors import AuthError, CacheError, UnreachableError
from kiln.cache.reference import parse_cache_url
from kiln.cache.registry import Registry

USER = "kiln"
PASSWORD = "Pw-7c1e-right"
WRONG = "Pw-3f9a-wrong"
IDENTITY = "Idt-55b2-refresh"
ISSUED = "Tok-90d4-bearer"  # what the token service hands out: a secret too
BLOB = b"layer bytes " * 100
DIGEST = "sha256:" + hashlib.sha256(BLOB).hexdigest()
SECRETS = (PASSWORD, WRONG, IDENTITY, ISSUED)


def encodings(secret: str) -> set[str]:
    forms = {secret, base64.b64encode(secret.encode()).decode(), quote(secret, safe=""), quote_plus(secret)}
    for user in (USER, "<token>"):
        forms.add(base64.b64encode(f"{user}:{secret}".encode()).decode())
    return forms


LEAK_FORMS = sorted(set().union(*(encodings(s) for s in SECRETS)))


class Origin(ThreadingHTTPServer):
    """One stand-in server; ``seen`` records every request (method, path, headers, body)."""

    daemon_threads = True

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)
        self.seen: list[str] = []
        self.mode = "ok"
        self.scheme = "basic"
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _record(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append(f"{self.command} {self.path}\n{self.headers}\n{body.decode(errors='replace')}")
        return body

    def _reply(self, code: int, body: bytes = b"{}", headers: dict | None = None, length: int | None = None):
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)


class Storage(_Handler):
    """Blob storage on another origin (as S3 behind a registry's redirect): serves the blob to anyone."""

    def do_GET(self):
        self._record()
        self._reply(200, BLOB)


class Registry_(_Handler):
    """The stand-in registry and its token service (``/token``)."""

    storage: Origin

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization")
        if self.server.scheme == "basic":
            return got == "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        return got == f"Bearer {ISSUED}"

    def _challenge(self):
        if self.server.scheme == "basic":
            value = 'Basic realm="standin"'
        else:
            value = f'Bearer realm="{self.server.url}/token",service="standin",scope="repository:c:pull"'
        self._reply(401, json.dumps({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})
                    .encode(), {"WWW-Authenticate": value})

    def _token(self, form: dict):
        basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        good = form.get("refresh_token") == [IDENTITY] or self.headers.get("Authorization") == basic
        if self.server.mode == "token-refuses" or not good:
            return self._reply(401, b'{"errors": [{"code": "DENIED"}]}')
        return self._reply(200, json.dumps({"token": ISSUED}).encode())

    def do_POST(self):
        body = self._record()
        if self.path.startswith("/token"):
            return self._token(parse_qs(body.decode()))
        self._reply(404)

    def do_GET(self):
        self._record()
        url = urlsplit(self.path)
        if url.path == "/token":
            return self._token(parse_qs(url.query))
        if not self._authorized():
            return self._challenge()
        if self.server.mode == "forbidden":
            return self._reply(403, b'{"errors": [{"code": "DENIED", "message": "requested access is denied"}]}')
        if url.path.startswith("/v2/c/blobs/"):
            if self.server.mode == "redirect":
                return self._reply(307, b"", {"Location": f"{self.server.storage.url}/blob?X-Sig=abc"})
            if self.server.mode == "broken":
                return self._reply(200, BLOB[:100], length=len(BLOB))  # the connection closes short
            return self._reply(200, BLOB)
        return self._reply(404, b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}')


@pytest.fixture(scope="module")
def servers():
    storage = Origin(Storage)
    registry = Origin(Registry_)
    registry.storage = storage
    yield registry, storage
    for s in (registry, storage):
        s.shutdown()
        s.server_close()


@pytest.fixture
def scan(servers, caplog, capsys):
    """Collects what left kiln's code in a test; at the end, asserts no secret form is in any of it."""
    registry, storage = servers
    registry.seen.clear()
    storage.seen.clear()
    registry.mode, registry.scheme = "ok", "basic"
    caplog.set_level(logging.DEBUG)

    def check(*texts: str) -> None:
        for text in texts:
            found = [form for form in LEAK_FORMS if form in text]
            assert not found, f"{found} in: {text[:400]}"

    def add(exc: BaseException) -> None:  # an error's message and traceback: checked at once
        check(str(exc), repr(exc), "".join(traceback.format_exception(exc)))

    yield add
    out = capsys.readouterr()
    check(out.out, out.err, caplog.text, *storage.seen)


def client(registry: Origin, secret: str = PASSWORD, identity: bool = False) -> Registry:
    creds = Credentials("<token>" if identity else USER, secret, "KILN_REGISTRY_PASSWORD", identity_token=identity)
    return Registry(parse_cache_url(f"oci+http://127.0.0.1:{registry.server_port}/c"), creds)


def _fails(call, scan) -> CacheError:
    with pytest.raises(CacheError) as caught:
        call()
    scan(caught.value)
    return caught.value


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_success_sends_the_secret_only_to_the_registry_and_its_token_service(servers, scan, scheme):
    registry, storage = servers
    registry.scheme = scheme
    reg = client(registry)
    assert reg.get_manifest("x") is None
    sink = io.BytesIO()
    reg.fetch_blob(DIGEST, len(BLOB), sink)
    assert sink.getvalue() == BLOB
    if scheme == "bearer":  # an identity (refresh) token is exchanged at the token service
        assert client(registry, IDENTITY, identity=True).get_manifest("x") is None
    # the secrets did go where they must (so the scan below is not vacuous)
    sent = "\n".join(registry.seen)
    assert base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode() in sent
    assert scheme == "basic" or (f"Bearer {ISSUED}" in sent and IDENTITY in sent)


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_a_redirect_to_blob_storage_carries_no_credentials(servers, scan, scheme):
    registry, storage = servers
    registry.scheme, registry.mode = scheme, "redirect"
    sink = io.BytesIO()
    client(registry).fetch_blob(DIGEST, len(BLOB), sink)
    assert sink.getvalue() == BLOB and len(storage.seen) == 1
    assert "authorization" not in storage.seen[0].lower()  # and the scan checks every secret form


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_refused_credentials_are_named_never_shown(servers, scan, scheme):
    registry, _ = servers
    registry.scheme = scheme
    wrong = _fails(lambda: client(registry, WRONG).get_manifest("x"), scan)
    assert isinstance(wrong, AuthError)
    assert "credentials for 'kiln' from KILN_REGISTRY_PASSWORD" in str(wrong)
    if scheme == "bearer":
        token = _fails(lambda: client(registry, WRONG, identity=True).get_manifest("x"), scan)
        assert isinstance(token, AuthError) and "token service refused" in str(token)


def test_a_token_service_that_refuses(servers, scan):
    registry, _ = servers
    registry.scheme, registry.mode = "bearer", "token-refuses"
    refused = _fails(lambda: client(registry).get_manifest("x"), scan)
    assert isinstance(refused, AuthError) and "token service refused" in str(refused)
    refused = _fails(lambda: client(registry, IDENTITY, identity=True).get_manifest("x"), scan)
    assert "token service refused" in str(refused)


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_forbidden(servers, scan, scheme):
    registry, _ = servers
    registry.scheme, registry.mode = scheme, "forbidden"
    forbidden = _fails(lambda: client(registry).get_manifest("x"), scan)
    assert isinstance(forbidden, AuthError) and "HTTP 403" in str(forbidden)


def test_a_transfer_that_breaks_off(servers, scan):
    registry, _ = servers
    registry.scheme, registry.mode = "bearer", "broken"
    broken = _fails(lambda: client(registry).fetch_blob(DIGEST, len(BLOB), io.BytesIO()), scan)
    assert isinstance(broken, UnreachableError) and "broke off" in str(broken), broken
    gone = Registry(parse_cache_url("oci+http://127.0.0.1:9/c"), Credentials(USER, PASSWORD, "test"))
    scan(_fails(lambda: gone.get_manifest("x"), scan))


def test_credentials_never_show_their_secret():
    creds = Credentials(USER, PASSWORD, "KILN_REGISTRY_PASSWORD")
    assert PASSWORD not in repr(creds) and PASSWORD not in str(creds) and PASSWORD not in f"{creds!r}{creds}"
