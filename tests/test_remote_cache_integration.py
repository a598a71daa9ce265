"""The remote cache with the real pipeline (real ModelOpt on the built-in model, fast int8_sq settings) and a real
OCI registry (docker-registry on 127.0.0.1, storage in a temp dir; skipped with the reason where it is absent).

One build by runner A (cache on, pushes) is shared by every test: runner B pulls instead of quantizing and ends
with a byte-identical Triton repository; a corrupt layer is caught and rebuilt; a push killed midway resumes
without re-sending complete layers (bytes counted by a relay in front of the registry); an interrupted pull
leaves nothing a later run accepts; a stopped registry falls back to a local build with a warning; and a second
registry with htpasswd auth takes credentials from the usual places, while a sentinel secret shows up in no
output, log, report, manifest or registry file."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from registry_harness import CountingProxy, registry_binary, start_registry

from kiln.pipeline.reports import SUMMARY_SCHEMA, json_schema
from kiln.recipe.catalog import configs_dir
from kiln.util.artifacts import read_manifest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(registry_binary() is None, reason="docker-registry is not installed "
                                 "(apt-get install docker-registry; .ci/run does)")]

RECIPE = str(configs_dir() / "tiny-llama.yaml")
FAST = ["--set", "quantization.format=int8_sq", "--set", "quantization.calibration.samples=8",
        "--set", "quantization.calibration.max_seq_len=64", "--set", "evaluation.samples=4",
        "--set", "evaluation.max_seq_len=64"]
# What may differ between two builds of one Triton repository: when and where it was built; in kiln.json the
# server command, which today names the package step's temporary directory; and so the size of kiln.json that
# the package manifest records.
VOLATILE = {"manifest.json": (("started",), ("seconds",), ("host",), ("files", "kiln.json"), ("pulled",)),
            "kiln.json": (("server_command",),)}
SENTINEL = "Sentinel-Passw0rd-4b9e1d"


def env_without_credentials(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_REGISTRY_", "KILN_REMOTE_CACHE"))}
    return {**env, "PYTHONUNBUFFERED": "1", "DOCKER_CONFIG": "/nonexistent", "REGISTRY_AUTH_FILE": "/nonexistent",
            **extra}


def kiln(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env or env_without_credentials())


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def runner_a(registry, tmp_path_factory):
    root = tmp_path_factory.mktemp("runner-a")
    proc = kiln("build", RECIPE, *FAST, "--cache", registry.url(), "--junit", "report.xml", "--json", "--quiet",
                cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root, json.loads(proc.stdout), proc


def statuses(summary: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary["steps"]}


def test_runner_a_builds_pushes_and_reports(runner_a, registry):
    root, summary, _ = runner_a
    jsonschema.validate(summary, json_schema(SUMMARY_SCHEMA))
    assert set(statuses(summary).values()) == {"ran"}
    pushed = {s["name"]: s["pushed_to"] for s in summary["steps"] if s["pushed_to"]}
    assert set(pushed) == {"quantize", "evaluate", "engine", "package"}
    assert pushed["quantize"] == f"{registry.url()}:quantize-{summary['steps'][1]['fingerprint']}"
    import xml.etree.ElementTree as ET

    cases = {c.get("name"): c for c in ET.parse(root / "report.xml").iter("testcase")}
    assert {"resolve", "quantize", "evaluate", "engine", "package"} <= set(cases)
    gate = cases["perplexity increase (evaluation.max_ppl_increase_pct)"]
    assert "perplexity rose" in gate.find("system-out").text and gate.find("failure") is None


def _tree(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(root))
        if p.name in VOLATILE:
            data = json.loads(p.read_text())
            for key_path in VOLATILE[p.name]:
                node = data
                *parents, last = key_path
                for key in parents:
                    node = node.get(key, {})
                node.pop(last, None)
            out[rel] = data
        else:
            out[rel] = p.read_bytes()
    return out


def test_runner_b_pulls_instead_of_quantizing_and_packages_the_same_repository(runner_a, registry, tmp_path):
    root_a, summary_a, _ = runner_a
    b = kiln("build", RECIPE, *FAST, "--cache", registry.url(), "--json", cwd=tmp_path)
    assert b.returncode == 0, b.stderr
    summary = json.loads(b.stdout)
    assert statuses(summary) == {"resolve": "ran", "quantize": "pulled", "evaluate": "pulled", "engine": "pulled",
                                 "package": "pulled", "tasks": "ran"}
    assert "calibrating" not in b.stderr and "quality:" not in b.stderr  # no quantize or evaluate step ran
    gates = {g["name"]: g["status"] for g in summary["steps"][2]["gates"]}
    assert gates == {"perplexity increase": "passed", "mean KL divergence": "off"}  # checked on pulled figures
    for step in ("quantize", "evaluate", "engine"):
        manifest = read_manifest(tmp_path / "build" / "tiny-llama" / step)
        assert manifest["pulled"]["from"].startswith(registry.url())
        assert manifest["fingerprint"] == next(s["fingerprint"] for s in summary_a["steps"] if s["name"] == step)
    assert _tree(tmp_path / "triton_repo") == _tree(root_a / "triton_repo")
    assert "↓ quantize: pulled" in b.stderr


def test_dry_run_json_gives_the_fingerprints_a_cache_keys_on(runner_a, registry, tmp_path):
    _, summary_a, _ = runner_a
    dry = kiln("build", RECIPE, *FAST, "--cache", registry.url(), "--dry-run", "--json", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    data = json.loads(dry.stdout)
    assert [s["fingerprint"] for s in data["steps"]] == [s["fingerprint"] for s in summary_a["steps"]]
    assert {s["name"]: s["remote"] for s in data["steps"]} == {"resolve": None, "quantize": "hit",
                                                              "evaluate": "hit", "engine": "hit", "package": "hit",
                                                              "tasks": None}
    assert not (tmp_path / "build").exists()  # a dry run writes nothing


def _quantize_entry(registry, fingerprint: str):
    from kiln.cache import artifact
    from kiln.cache.reference import parse_cache_url
    from kiln.cache.registry import Registry

    reg = Registry(parse_cache_url(registry.url()))
    return reg, artifact.read_entry(reg, f"quantize-{fingerprint}")


def test_a_corrupt_layer_in_the_registry_is_detected_and_rebuilt(runner_a, registry, tmp_path):
    _, summary_a, _ = runner_a
    _, entry = _quantize_entry(registry, summary_a["steps"][1]["fingerprint"])
    victim = max(entry.parts, key=lambda p: p.size)
    blob = registry.blob_path(victim.digest)
    original = blob.read_bytes()
    try:
        blob.write_bytes(original[:4096] + bytes([original[4096] ^ 0xFF]) + original[4097:])
        c = kiln("build", RECIPE, *FAST, "--cache", registry.url(), "--to", "quantize", "--json", cwd=tmp_path)
    finally:
        blob.write_bytes(original)
    assert c.returncode == 0, c.stderr
    assert statuses(json.loads(c.stdout))["quantize"] == "ran"
    assert f"blob {victim.digest} is corrupt" in c.stderr and "building it here" in c.stderr
    manifest = read_manifest(tmp_path / "build" / "tiny-llama" / "quantize", ("checkpoint/model.safetensors",))
    assert manifest is not None and "pulled" not in manifest


def _kill_when(proc: subprocess.Popen, predicate, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            time.sleep(0.3)  # let it block on the stalled connection
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("never reached the point to kill it at")


def test_a_killed_push_resumes_without_resending_complete_layers(runner_a, registry, tmp_path):
    root_a, summary_a, _ = runner_a
    proxy = CountingProxy(registry.port)
    try:
        url = proxy.url("resume")  # a fresh repository: it holds none of the layers yet
        args = [sys.executable, "-m", "kiln", "cache", "push", RECIPE, *FAST, "--set", "cache.layer_mb=1",
                "--step", "quantize", "--cache", url, "--build-dir", str(root_a / "build"), "--quiet"]
        total = sum(read_manifest(root_a / "build" / "tiny-llama" / "quantize")["files"].values())
        proxy.reset(stall_up_after=total // 2)
        first = subprocess.Popen(args, cwd=tmp_path, env=env_without_credentials(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        _kill_when(first, lambda: proxy.stalled("up"))
        from kiln.cache import artifact
        from kiln.cache.reference import parse_cache_url
        from kiln.cache.registry import Registry

        reg = Registry(parse_cache_url(registry.url("resume")))
        assert reg.get_manifest(f"quantize-{summary_a['steps'][1]['fingerprint']}") is None  # no entry yet
        parts = artifact.plan_parts(root_a / "build" / "tiny-llama" / "quantize",
                                    read_manifest(root_a / "build" / "tiny-llama" / "quantize")["files"], 1 << 20)
        complete = sum(p.size for p in {p.digest: p for p in parts}.values() if reg.blob_exists(p.digest))
        assert complete >= total // 4, (complete, total)
        proxy.reset()
        second = subprocess.run(args, cwd=tmp_path, env=env_without_credentials(), capture_output=True, text=True)
        assert second.returncode == 0, second.stderr
        assert "quantize: pushed to" in second.stdout
        # What the resumed push sent: the layers the registry lacked, plus HTTP requests and the manifests.
        assert total - complete <= proxy.up <= total - complete + (256 << 10), (proxy.up, total, complete)
        assert reg.get_manifest(f"quantize-{summary_a['steps'][1]['fingerprint']}") is not None

        # An interrupted pull (the connection dies, the puller is killed) leaves nothing a later run accepts.
        puller = tmp_path / "puller"
        pull = [sys.executable, "-m", "kiln", "cache", "pull", RECIPE, *FAST, "--step", "quantize", "--cache", url,
                "--quiet"]
        proxy.reset(stall_down_after=total // 2)
        puller.mkdir()
        p = subprocess.Popen(pull, cwd=puller, env=env_without_credentials(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        _kill_when(p, lambda: proxy.stalled("down"))
        quantize = puller / "build" / "tiny-llama" / "quantize"
        assert read_manifest(quantize) is None and list(quantize.parent.glob(".quantize.tmp-*"))
        proxy.reset()
        dry = kiln("build", RECIPE, *FAST, "--dry-run", "--json", cwd=puller)
        assert {s["name"]: s["action"] for s in json.loads(dry.stdout)["steps"]}["quantize"] == "run"
        again = subprocess.run(pull, cwd=puller, env=env_without_credentials(), capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        assert read_manifest(quantize)["pulled"] and not list(quantize.parent.glob(".quantize.tmp-*"))
    finally:
        proxy.close()


def test_a_stopped_registry_falls_back_to_a_local_build_with_a_warning(runner_a, tmp_path):
    down = start_registry(tmp_path / "down")
    down.stop()
    d = kiln("build", RECIPE, *FAST, "--cache", down.url(), "--to", "quantize", "--json", cwd=tmp_path / "d")
    assert d.returncode == 0, d.stderr
    assert statuses(json.loads(d.stdout))["quantize"] == "ran"
    assert f"warning: remote cache {down.url()}: pulling quantize: cannot reach registry {down.host}" in \
        d.stderr.replace("\n", " ")
    required = kiln("build", RECIPE, *FAST, "--cache", down.url(), "--cache-required", "--to", "quantize",
                    cwd=tmp_path / "e")
    assert required.returncode == 1 and "cannot reach registry" in required.stderr
    assert "--cache-required" in required.stderr


def test_an_authenticated_registry_with_credentials_from_the_usual_places(runner_a, tmp_path):
    root_a, summary_a, _ = runner_a
    reg = start_registry(tmp_path / "auth-registry", auth=("kiln", SENTINEL))
    outputs: list[str] = []
    try:
        url = reg.url("team/kiln-cache")
        common = [RECIPE, *FAST, "--cache", url]
        # No credentials anywhere: a clear refusal naming the fix (push under kiln cache is always required).
        none = kiln("cache", "push", *common, "--build-dir", str(root_a / "build"), "--repo-dir", str(root_a / "triton_repo"), cwd=tmp_path / "none")
        outputs += [none.stdout, none.stderr]
        assert none.returncode == 1 and "needs credentials and none were found" in none.stderr
        assert "docker login" in none.stderr
        # docker login / oras login: ~/.docker/config.json (here $DOCKER_CONFIG)
        docker = tmp_path / "docker"
        docker.mkdir()
        auth = base64.b64encode(f"kiln:{SENTINEL}".encode()).decode()
        (docker / "config.json").write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
        env = env_without_credentials(DOCKER_CONFIG=str(docker))
        push = kiln("cache", "push", *common, "--build-dir", str(root_a / "build"), "--repo-dir", str(root_a / "triton_repo"), cwd=tmp_path / "p", env=env)
        outputs += [push.stdout, push.stderr]
        assert push.returncode == 0, push.stderr
        assert "quantize: pushed to" in push.stdout and "engine: pushed to" in push.stdout
        # A build that pulls, authenticated the same way.
        b = kiln("build", *common, "--to", "quantize", "--json", "--junit", "r.xml", cwd=tmp_path / "b", env=env)
        outputs += [b.stdout, b.stderr, (tmp_path / "b" / "r.xml").read_text()]
        assert b.returncode == 0, b.stderr
        assert statuses(json.loads(b.stdout))["quantize"] == "pulled"
        # CI secrets as environment variables.
        env_vars = env_without_credentials(KILN_REGISTRY_USERNAME="kiln", KILN_REGISTRY_PASSWORD=SENTINEL)
        ls = kiln("cache", "ls", RECIPE, *FAST, "--cache", url, "--json", cwd=tmp_path / "ls", env=env_vars)
        outputs += [ls.stdout, ls.stderr]
        assert ls.returncode == 0, ls.stderr
        current = {e["step"] for e in json.loads(ls.stdout)["entries"] if e["current"]}
        assert current == {"quantize", "evaluate", "engine", "package"}
        # Wrong credentials: refused, the source named, the build falls back (or fails when required).
        wrong = env_without_credentials(KILN_REGISTRY_USERNAME="kiln", KILN_REGISTRY_PASSWORD=SENTINEL + "x")
        bad = kiln("build", *common, "--to", "resolve", "--set", "cache.share=[resolve]", cwd=tmp_path / "bad",
                   env=wrong)
        outputs += [bad.stdout, bad.stderr]
        assert bad.returncode == 0 and "refused credentials for 'kiln' from KILN_REGISTRY_USERNAME" in bad.stderr
        assert "warning:" in bad.stderr
        bad_required = kiln("cache", "pull", *common, cwd=tmp_path / "bad2", env=wrong)
        outputs += [bad_required.stdout, bad_required.stderr]
        assert bad_required.returncode == 1 and "refused credentials" in bad_required.stderr
    finally:
        reg.stop()
    # The secret (and its base64 forms, as a Basic header carries it) is in no output, file or registry blob.
    forms = [SENTINEL.encode(), base64.b64encode(f"kiln:{SENTINEL}".encode()),
             base64.b64encode(f"kiln:{SENTINEL}x".encode())]
    for text in outputs:
        assert not any(f.decode() in text for f in forms)
    scanned = 0
    for root in (tmp_path / "none", tmp_path / "p", tmp_path / "b", tmp_path / "ls", tmp_path / "bad",
                 tmp_path / "bad2", reg.storage):
        for path in root.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                scanned += 1
                assert not any(f in data for f in forms), path
    assert scanned > 20
    assert SENTINEL.encode() not in reg.log.read_bytes()
