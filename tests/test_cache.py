"""The remote cache's parts without a registry: addresses, credentials from the usual places (and never shown),
the recipe's cache section, and the reports CI reads (JSON with published schemas, JUnit XML)."""

from __future__ import annotations

import base64
import json
import os
import stat
import typing
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from kiln.cache.credentials import Credentials, find_credentials
from kiln.cache.reference import parse_cache_url
from kiln.pipeline import reports
from kiln.pipeline.registry import STEP_ORDER
from kiln.pipeline.runner import RunSummary, Status, StepOutcome
from kiln.recipe.schema import ShareableStep
from kiln.steps.evaluate import EvaluateResult, quality_gates

SECRET = "s3cr3t-Sentinel-7f1c"


# ------------------------------------------------------------------------------------------ addresses
@pytest.mark.parametrize("url, scheme, host, repo", [
    ("oci://registry.example.com/team/kiln-cache", "https", "registry.example.com", "team/kiln-cache"),
    ("oci+http://127.0.0.1:5000/kiln-cache", "http", "127.0.0.1:5000", "kiln-cache"),
    ("oci+https://Harbor.Example.com:8443/a/b.c_d/e", "https", "harbor.example.com:8443", "a/b.c_d/e"),
])
def test_cache_addresses(url, scheme, host, repo):
    ref = parse_cache_url(url)
    assert (ref.scheme, ref.host, ref.repository) == (scheme, host, repo)
    assert ref.base == f"{scheme}://{host}/v2/{repo}"


@pytest.mark.parametrize("url, fix", [
    ("registry.example.com/x", "oci://HOST"),
    ("https://registry.example.com/x", "unknown scheme"),
    (f"oci://user:{SECRET}@registry.example.com/x", "never put them in a recipe"),
    ("oci://registry.example.com/Team/x", "lower-case"),
    ("oci://registry.example.com/x:latest", "tag or digest"),
    ("oci://registry.example.com/", "lower-case"),
    ("oci:///x", "valid registry host"),
])
def test_bad_cache_addresses_say_how_to_fix_them_and_never_repeat_a_secret(url, fix):
    with pytest.raises(ValueError) as exc:
        parse_cache_url(url)
    assert fix in str(exc.value) and SECRET not in str(exc.value)


def test_a_recipe_with_credentials_in_its_cache_address_is_refused_without_echoing_them(kiln, write_recipe):
    path = write_recipe(f"name: x\ntarget: reference\ncache:\n  remote: oci://kiln:{SECRET}@r.example.com/c\n")
    result = kiln("validate", path)
    assert result.exit_code == 2
    assert "cache.remote" in result.output and ":4" in result.output and "docker login" in result.output
    assert SECRET not in result.output
    result = kiln("build", "--dry-run", path, "--cache", f"oci://kiln:{SECRET}@r.example.com/c")
    assert result.exit_code == 2 and SECRET not in result.output


def test_the_cache_section_is_never_part_of_a_fingerprint(tmp_path, write_recipe):
    from kiln.pipeline.runner import Layout, schedule
    from kiln.recipe.loader import load_recipe

    path = write_recipe("name: x\ntarget: reference\n")
    plain = load_recipe(path)
    cached = load_recipe(path, ("cache.remote=oci://r.example.com/c", "cache.layer_mb=8", "cache.share=[resolve]"))
    fps = [[p.fingerprint for p in schedule(loaded, Layout(tmp_path))] for loaded in (plain, cached)]
    assert fps[0] == fps[1]


def test_shareable_steps_are_the_pipelines_steps():
    assert typing.get_args(ShareableStep) == tuple(STEP_ORDER)


# ------------------------------------------------------------------------------------------ credentials
def _docker_config(tmp_path: Path, config: dict) -> dict[str, str]:
    (tmp_path / "docker").mkdir(exist_ok=True)
    (tmp_path / "docker" / "config.json").write_text(json.dumps(config))
    return {"DOCKER_CONFIG": str(tmp_path / "docker"), "HOME": str(tmp_path / "home")}


def test_credentials_from_the_environment_win(tmp_path):
    env = _docker_config(tmp_path, {"auths": {"r.example.com": {"auth": base64.b64encode(b"a:b").decode()}}})
    env.update(KILN_REGISTRY_USERNAME="ci", KILN_REGISTRY_PASSWORD=SECRET)
    found = find_credentials("r.example.com", env)
    assert (found.username, found.secret) == ("ci", SECRET)
    assert SECRET not in repr(found) and SECRET not in str(found) and "KILN_REGISTRY_PASSWORD" in str(found)


@pytest.mark.parametrize("key", ["r.example.com:5000", "https://r.example.com:5000", "http://r.example.com:5000/v2/"])
def test_credentials_from_docker_and_oras_login(tmp_path, key):
    auth = base64.b64encode(f"kiln:{SECRET}".encode()).decode()
    env = _docker_config(tmp_path, {"auths": {"other.example.com": {"auth": "eDp5"}, key: {"auth": auth}}})
    found = find_credentials("r.example.com:5000", env)
    assert (found.username, found.secret, found.source) == ("kiln", SECRET, str(tmp_path / "docker" / "config.json"))
    assert find_credentials("r.example.com", env) is None  # another port is another registry


def test_an_identity_token_is_kept_as_one(tmp_path):
    env = _docker_config(tmp_path, {"auths": {"r.example.com": {"identitytoken": SECRET}}})
    found = find_credentials("r.example.com", env)
    assert found.identity_token and found.secret == SECRET


def test_credentials_from_a_credential_helper(tmp_path):
    """The helper is a stand-in script, named as one, speaking the docker-credential-helpers protocol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-standin"
    helper.write_text("#!/bin/sh\nread host\n[ \"$1\" = get ] && [ \"$host\" = r.example.com ] && "
                      f"echo '{{\"ServerURL\":\"r.example.com\",\"Username\":\"kiln\",\"Secret\":\"{SECRET}\"}}' "
                      "&& exit 0\necho 'credentials not found in native keychain'; exit 1\n")
    helper.chmod(helper.stat().st_mode | stat.S_IEXEC)
    env = _docker_config(tmp_path, {"credHelpers": {"r.example.com": "standin"}})
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    found = find_credentials("r.example.com", env)
    assert (found.username, found.secret, found.source) == ("kiln", SECRET, "docker-credential-standin")
    store = _docker_config(tmp_path, {"credsStore": "standin"})
    store["PATH"] = env["PATH"]
    assert find_credentials("r.example.com", store).secret == SECRET
    assert find_credentials("elsewhere.example.com", store) is None


def test_credentials_from_podman_login(tmp_path):
    auth = base64.b64encode(f"kiln:{SECRET}".encode()).decode()
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"auths": {"r.example.com": {"auth": auth}}}))
    env = {"HOME": str(tmp_path / "home"), "REGISTRY_AUTH_FILE": str(path)}
    assert find_credentials("r.example.com", env) == Credentials("kiln", SECRET, str(path))
    assert find_credentials("r.example.com", {"HOME": str(tmp_path / "home")}) is None


# ------------------------------------------------------------------------------------------ reports
def _summary(failure=None, gate_pct: float = 10.0) -> RunSummary:
    from kiln.pipeline.runner import StepResult
    from kiln.recipe.schema import Recipe

    recipe = Recipe.model_validate({"name": "x", "evaluation": {"max_ppl_increase_pct": gate_pct, "max_kl": 0.5}})
    ev = EvaluateResult(summary="ppl 10.000 → 12.000 (+20.00%), KL 0.01000", format="int8_sq",
                        base_perplexity=10.0, quant_perplexity=12.0, ppl_increase_pct=20.0, mean_kl=0.01)
    outcomes = [
        StepOutcome("resolve", Status.SKIPPED, 0.0, Path("build/x/resolve"), StepResult(summary="ok"), "up to date",
                    fingerprint="a" * 64),
        StepOutcome("quantize", Status.PULLED, 1.5, Path("build/x/quantize"), StepResult(summary="int8_sq"),
                    fingerprint="b" * 64, pulled_from="oci+http://127.0.0.1:1/c:quantize-" + "b" * 64),
        StepOutcome("evaluate", Status.RAN, 3.0, Path("build/x/evaluate"), ev, fingerprint="c" * 64,
                    gates=quality_gates(recipe, ev)),
        StepOutcome("engine", Status.NOT_RUN),
        StepOutcome("package", Status.NOT_RUN),
        StepOutcome("tasks", Status.NOT_RUN),
    ]
    return RunSummary("x", outcomes, failure, 4.5, cache="oci+http://127.0.0.1:1/c")


def test_the_json_summary_validates_against_its_published_schema():
    from kiln.util.errors import KilnError

    schema = reports.json_schema(reports.SUMMARY_SCHEMA)
    jsonschema.Draft202012Validator.check_schema(schema)
    data = json.loads(reports.summary_json(_summary(failure=KilnError("perplexity rose 20%"))))
    jsonschema.validate(data, schema)
    assert data["schema_version"] == 1 and data["ok"] is False and data["exit_code"] == 1
    assert data["steps"][1]["status"] == "pulled" and data["steps"][1]["pulled_from"].endswith("b" * 64)
    assert [g["status"] for g in data["steps"][2]["gates"]] == ["failed", "passed"]
    data["steps"][0]["surprise"] = 1  # an undocumented field is a schema violation: the schema is the contract
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)


def test_junit_has_a_case_per_step_and_per_gate_criterion_with_the_figures():
    from kiln.util.errors import KilnError

    message = "perplexity rose 20.0% (10.00 → 12.00), gate is 10%"
    root = ET.fromstring(reports.junit_xml(_summary(failure=KilnError(message))))
    suite = root.find("testsuite")
    cases = {(c.get("classname").rsplit(".", 1)[1], c.get("name")): c for c in suite.iter("testcase")}
    assert [k for k in cases if k[0] == "steps"] == [("steps", s) for s in STEP_ORDER]
    ppl = cases[("quality_gate", "perplexity increase (evaluation.max_ppl_increase_pct)")]
    assert ppl.find("failure").get("message").startswith(message)
    kl = cases[("quality_gate", "mean KL divergence (evaluation.max_kl)")]
    assert kl.find("failure") is None and "0.01 nats per token, gate is 0.5" in kl.find("system-out").text
    assert cases[("steps", "evaluate")].find("failure") is None  # the measurement ran; the gate failed
    assert cases[("steps", "engine")].find("skipped") is not None
    assert "pulled from: oci+http://" in cases[("steps", "quantize")].find("system-out").text
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("8", "1", "3")


def test_the_schedule_json_validates_and_gives_every_fingerprint(tmp_path, write_recipe):
    from kiln.pipeline.runner import Layout, schedule
    from kiln.recipe.loader import load_recipe

    loaded = load_recipe(write_recipe("name: x\ntarget: reference\n"))
    scheduled = schedule(loaded, Layout(tmp_path))
    data = reports.schedule_dict(scheduled, loaded, lambda p: "miss")
    jsonschema.validate(data, reports.json_schema(reports.SCHEDULE_SCHEMA))
    assert [s["fingerprint"] for s in data["steps"]] == [p.fingerprint for p in scheduled]
    assert {s["remote"] for s in data["steps"]} == {"miss"}


def test_build_dry_run_json_on_the_command_line(kiln, write_recipe, monkeypatch):
    monkeypatch.delenv("KILN_REMOTE_CACHE", raising=False)
    result = kiln("build", write_recipe("name: x\ntarget: reference\n"), "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    jsonschema.validate(data, reports.json_schema(reports.SCHEDULE_SCHEMA))
    assert [s["name"] for s in data["steps"]] == list(STEP_ORDER) and data["cache"] is None


# ------------------------------------------------------------------------------------------ token auth
@pytest.fixture
def token_registry():
    """A stand-in registry with Bearer token auth (named as one: distribution needs an external token service
    for this), speaking the challenge / token-service protocol real registries (GHCR, Harbor, ECR) use."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlsplit

    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, code: int, body: dict | None = None, headers: dict | None = None):
            data = json.dumps(body or {}).encode()
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _token(self, form: dict):
            seen.append(form)
            basic = "Basic " + base64.b64encode(f"kiln:{SECRET}".encode()).decode()
            if form.get("grant_type") == ["refresh_token"] and form.get("refresh_token") == [SECRET]:
                return self._reply(200, {"access_token": "good-token"})
            if self.headers.get("Authorization") == basic:
                return self._reply(200, {"token": "good-token"})
            return self._reply(401, {"errors": [{"code": "UNAUTHORIZED"}]})

        def do_GET(self):
            url = urlsplit(self.path)
            if url.path == "/token":
                return self._token(parse_qs(url.query))
            if self.headers.get("Authorization") != "Bearer good-token":
                realm = f"http://127.0.0.1:{self.server.server_port}/token"
                return self._reply(401, {}, {"WWW-Authenticate": f'Bearer realm="{realm}",service="standin",'
                                                                 f'scope="repository:c:pull"'})
            return self._reply(404, {"errors": [{"code": "MANIFEST_UNKNOWN"}]})

        def do_POST(self):
            length = int(self.headers.get("Content-Length", 0))
            return self._token(parse_qs(self.rfile.read(length).decode()))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"oci+http://127.0.0.1:{server.server_port}/c", seen
    server.shutdown()


def test_bearer_token_auth_with_a_password_or_an_identity_token(token_registry):
    from kiln.cache.errors import AuthError
    from kiln.cache.registry import Registry

    url, seen = token_registry
    assert Registry(parse_cache_url(url), Credentials("kiln", SECRET, "test")).get_manifest("x") is None
    assert seen[-1] == {"service": ["standin"], "scope": ["repository:c:pull"]}
    token = Credentials("<token>", SECRET, "test", identity_token=True)
    assert Registry(parse_cache_url(url), token).get_manifest("x") is None
    assert seen[-1]["grant_type"] == ["refresh_token"] and seen[-1]["scope"] == ["repository:c:pull"]
    with pytest.raises(AuthError) as exc:
        Registry(parse_cache_url(url), Credentials("kiln", "wrong", "KILN_REGISTRY_PASSWORD")).get_manifest("x")
    assert "token service refused credentials for 'kiln' from KILN_REGISTRY_PASSWORD" in str(exc.value)
    assert "wrong" not in str(exc.value)


def test_where_the_cache_address_comes_from(monkeypatch):
    import kiln.cli.main  # noqa: F401  (the CLI modules import each other through it)
    from kiln.cli.commands import cache_overrides

    monkeypatch.setenv("KILN_REMOTE_CACHE", "oci://env.example.com/c")
    assert cache_overrides((), None) == ("cache.remote=oci://env.example.com/c",)
    assert cache_overrides((), "oci://cli.example.com/c") == ("cache.remote=oci://cli.example.com/c",)
    explicit = ("cache.remote=oci://set.example.com/c",)
    assert cache_overrides(explicit, None) == explicit  # --set beats the environment
    assert cache_overrides((), "none") == ("cache.remote=null",)
    monkeypatch.delenv("KILN_REMOTE_CACHE")
    assert cache_overrides(("serving.http_port=1",), None) == ("serving.http_port=1",)


def test_cache_none_turns_a_recipes_remote_cache_off(kiln, write_recipe, monkeypatch):
    monkeypatch.delenv("KILN_REMOTE_CACHE", raising=False)
    path = write_recipe("name: x\ntarget: reference\ncache:\n  remote: oci://r.example.com/c\n")
    on = json.loads(kiln("build", path, "--dry-run", "--json", "--set", "cache.pull=false").output)
    assert on["cache"] == "oci://r.example.com/c"
    off = json.loads(kiln("build", path, "--dry-run", "--json", "--cache", "none").output)
    assert off["cache"] is None
