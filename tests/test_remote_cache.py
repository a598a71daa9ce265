"""The runner's remote-cache hook against a real registry (docker-registry on 127.0.0.1, storage in a temp dir),
with fast stand-in steps (named as such): pull instead of run, push after, every failure falling back to a local
build with a warning (or failing under --cache-required), and nothing partial ever accepted. The real pipeline
against the same registry is in test_remote_cache_integration.py."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
from registry_harness import registry_binary, start_registry
from rich.console import Console

from kiln.cache import artifact
from kiln.pipeline import runner
from kiln.pipeline.remote import RemoteCache, tag_for
from kiln.recipe.loader import load_recipe
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.util.artifacts import read_manifest

pytestmark = pytest.mark.skipif(registry_binary() is None, reason="docker-registry is not installed "
                                "(apt-get install docker-registry; .ci/run does)")

CALLS: list[str] = []


class StandInResult(StepResult):
    """The stand-in steps' result."""

    step: str


def _writer(name: str):
    def fn(ctx: StepContext) -> StandInResult:
        CALLS.append(name)
        (ctx.out_dir / "out.txt").write_text(f"{name} output")
        if name == "quantize":  # several layers at cache.layer_mb 1, and a nested, an empty and a private file
            (ctx.out_dir / "checkpoint").mkdir()
            (ctx.out_dir / "checkpoint" / "weights.bin").write_bytes(os.urandom(2_500_000))
            (ctx.out_dir / "checkpoint" / "empty").write_bytes(b"")
            os.chmod(ctx.out_dir / "checkpoint" / "weights.bin", 0o600)
        return StandInResult(summary=f"{name} done", step=name)

    return fn


def _spec(name: str, keys: tuple[str, ...], **kw) -> StepSpec:
    return StepSpec(name, _writer(name), StandInResult, keys, files=("out.txt",), **kw)


SPECS = {
    "resolve": _spec("resolve", ("model",)),
    "quantize": _spec("quantize", ("model", "quantization", "target"), after=("resolve",)),
    "evaluate": _spec("evaluate", ("evaluation",), after=("quantize",)),
    "engine": _spec("engine", ("engine",), after=("quantize",)),
    "package": _spec("package", ("serving", "engine"), after=("engine", "evaluate"),
                     output_dir=lambda loaded, root: root / loaded.recipe.name),
    "tasks": _spec("tasks", ("evaluation",), after=("package",)),
}


@pytest.fixture(autouse=True)
def fake_steps(monkeypatch):
    monkeypatch.setattr(runner, "load_steps", lambda: dict(SPECS))
    CALLS.clear()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = start_registry(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture
def recipe_file(tmp_path: Path, registry, request) -> Path:
    p = tmp_path / "r.yaml"
    repo = "t/" + hashlib.sha256(request.node.name.encode()).hexdigest()[:12]  # a repository per test
    p.write_text(f"name: pipe\ntarget: reference\nquantization:\n  format: int8_sq\n"
                 f"cache:\n  remote: {registry.url(repo)}\n  layer_mb: 1\n")
    return p


def build(recipe_file: Path, root: Path, *overrides: str, required: bool = False, console=None):
    loaded = load_recipe(recipe_file, overrides)
    console = console or Console(file=open(os.devnull, "w"))
    remote = RemoteCache.for_recipe(loaded, required=required, console=console, progress=False)
    return runner.run(loaded, runner.Layout(root / "build", root / "repo"), progress=False, console=console,
                      remote=remote)


def statuses(summary) -> dict[str, str]:
    return {o.name: o.status.value for o in summary.outcomes}


def recorder() -> tuple[Console, list]:
    import io

    buf = io.StringIO()
    return Console(file=buf, width=300), buf


def test_a_fresh_runner_pulls_the_shared_steps_instead_of_running_them(recipe_file, tmp_path):
    a = build(recipe_file, tmp_path / "a")
    assert a.failure is None and statuses(a)["quantize"] == "ran"
    pushed = {o.name: o.pushed_to for o in a.outcomes if o.pushed_to}
    assert set(pushed) == {"quantize", "evaluate", "engine", "package"}  # the default policy: cache.share
    CALLS.clear()
    b = build(recipe_file, tmp_path / "b")
    assert b.failure is None
    assert statuses(b) == {"resolve": "ran", "quantize": "pulled", "evaluate": "pulled", "engine": "pulled",
                           "package": "pulled", "tasks": "ran"}
    assert CALLS == ["resolve", "tasks"]
    src, dst = tmp_path / "a" / "build" / "pipe" / "quantize", tmp_path / "b" / "build" / "pipe" / "quantize"
    for f in ("out.txt", "checkpoint/weights.bin", "checkpoint/empty"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    assert os.stat(dst / "checkpoint" / "weights.bin").st_mode & 0o777 == 0o600
    manifest = read_manifest(dst, ("out.txt",))
    assert manifest is not None and manifest["pulled"]["from"] == pushed["quantize"]
    assert manifest["fingerprint"] == a.outcomes[1].fingerprint
    CALLS.clear()
    again = build(recipe_file, tmp_path / "b")  # pulled outputs are complete outputs: nothing runs, nothing pushed
    assert set(statuses(again).values()) == {"skipped"} and CALLS == []
    assert all(o.pushed_to is None for o in again.outcomes)


def test_files_go_as_bounded_layers_and_a_push_skips_layers_the_registry_has(recipe_file, tmp_path, registry):
    build(recipe_file, tmp_path / "a")
    loaded = load_recipe(recipe_file)
    remote = RemoteCache.for_recipe(loaded, progress=False, console=Console(file=open(os.devnull, "w")))
    layout = runner.Layout(tmp_path / "a" / "build")
    quantize = next(p for p in runner.schedule(loaded, layout) if p.spec.name == "quantize")
    entry = artifact.read_entry(remote.registry, tag_for("quantize", quantize.fingerprint))
    assert max(p.size for p in entry.parts) <= 1 << 20
    assert len([p for p in entry.parts if p.path == "checkpoint/weights.bin"]) == 3
    out = quantize.out_dir
    again = artifact.push(remote.registry, "copy", out, read_manifest(out), 1 << 20, {})
    assert again.layers_skipped == again.layers and again.bytes_moved == 0


def test_a_corrupt_layer_is_detected_and_the_step_built_here(recipe_file, tmp_path, registry):
    build(recipe_file, tmp_path / "a")
    loaded = load_recipe(recipe_file)
    remote = RemoteCache.for_recipe(loaded, progress=False)
    p = next(p for p in runner.schedule(loaded, runner.Layout(tmp_path / "a" / "build")) if p.spec.name == "quantize")
    entry = artifact.read_entry(remote.registry, tag_for("quantize", p.fingerprint))
    victim = max(entry.parts, key=lambda part: part.size)
    blob = registry.blob_path(victim.digest)
    original = blob.read_bytes()
    try:
        blob.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
        CALLS.clear()
        console, text = recorder()
        b = build(recipe_file, tmp_path / "b", console=console)
        assert b.failure is None and statuses(b)["quantize"] == "ran" and "quantize" in CALLS
        log = text.getvalue()
        assert f"blob {victim.digest} is corrupt" in log and "building it here" in log
        assert "quantize not pushed" in log
        assert "pulled" not in read_manifest(tmp_path / "b" / "build" / "pipe" / "quantize", ("out.txt",))
        required = build(recipe_file, tmp_path / "c", required=True)
        assert required.failure is not None and "corrupt" in str(required.failure)
        assert "--cache-required" in str(required.failure)
        assert read_manifest(tmp_path / "c" / "build" / "pipe" / "quantize") is None
    finally:
        blob.write_bytes(original)


def test_an_entry_whose_components_do_not_hash_to_its_fingerprint_is_refused(recipe_file, tmp_path, registry):
    build(recipe_file, tmp_path / "a")
    loaded = load_recipe(recipe_file)
    remote = RemoteCache.for_recipe(loaded, progress=False)
    p = next(p for p in runner.schedule(loaded, runner.Layout(tmp_path / "a" / "build")) if p.spec.name == "quantize")
    manifest = dict(read_manifest(p.out_dir))
    manifest["components"] = {**manifest["components"], "tools": {"kiln": "forged"}}
    artifact.push(remote.registry, tag_for("quantize", p.fingerprint), p.out_dir, manifest, 1 << 20,
                  {artifact.A_FINGERPRINT: p.fingerprint})
    console, text = recorder()
    b = build(recipe_file, tmp_path / "b", console=console)
    assert statuses(b)["quantize"] == "ran"
    assert "do not hash to its fingerprint" in text.getvalue()


def test_a_stopped_registry_falls_back_to_a_local_build_with_a_warning(tmp_path, registry):
    down = start_registry(tmp_path / "down")
    down.stop()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: pipe\ntarget: reference\ncache:\n  remote: {down.url()}\n")
    console, text = recorder()
    summary = build(recipe, tmp_path / "a", console=console)
    assert summary.failure is None and set(statuses(summary).values()) == {"ran"}
    log = text.getvalue()
    assert f"cannot reach registry {down.host}: Connection refused" in log
    assert log.count("warning:") == 1  # the rest of the build does not try again
    assert summary.cache_warnings and "building it here" in summary.cache_warnings[0]
    failed = build(recipe, tmp_path / "b", required=True)
    assert failed.failure is not None and "cannot reach registry" in str(failed.failure)
    assert statuses(failed)["quantize"] == "failed" and statuses(failed)["package"] == "not run"


def test_an_interrupted_pull_leaves_nothing_a_later_run_accepts(recipe_file, tmp_path, monkeypatch):
    build(recipe_file, tmp_path / "a")
    real_fetch = artifact.Registry.fetch_blob
    seen = []

    def dies_midway(self, digest, size, sink, on_bytes=None):
        seen.append(digest)
        if len(seen) == 3:  # after two layers were written: as a SIGKILL would
            raise KeyboardInterrupt
        return real_fetch(self, digest, size, sink, on_bytes)

    monkeypatch.setattr(artifact.Registry, "fetch_blob", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        build(recipe_file, tmp_path / "b")
    quantize = tmp_path / "b" / "build" / "pipe" / "quantize"
    assert not quantize.exists() and read_manifest(quantize) is None
    monkeypatch.setattr(artifact.Registry, "fetch_blob", real_fetch)
    CALLS.clear()
    b = build(recipe_file, tmp_path / "b")
    assert statuses(b)["quantize"] == "pulled" and "quantize" not in CALLS


def test_pull_off_pushes_only_and_push_off_pulls_only(recipe_file, tmp_path):
    a = build(recipe_file, tmp_path / "a", "cache.push=false")
    assert all(o.pushed_to is None for o in a.outcomes)
    b = build(recipe_file, tmp_path / "b", "cache.pull=false")
    assert statuses(b)["quantize"] == "ran" and any(o.pushed_to for o in b.outcomes)
    c = build(recipe_file, tmp_path / "c", "cache.share=[quantize]")
    assert statuses(c)["quantize"] == "pulled" and statuses(c)["engine"] == "ran" and statuses(c)["evaluate"] == "ran"


def test_an_up_to_date_output_the_registry_lacks_is_pushed(recipe_file, tmp_path):
    build(recipe_file, tmp_path / "a", "cache.push=false")
    again = build(recipe_file, tmp_path / "a")
    assert set(statuses(again).values()) == {"skipped"}
    assert {o.name for o in again.outcomes if o.pushed_to} == {"quantize", "evaluate", "engine", "package"}
    # Each pushed reference names an entry the registry now holds, for this very output.
    loaded = load_recipe(recipe_file)
    remote = RemoteCache.for_recipe(loaded, progress=False, console=Console(file=open(os.devnull, "w")))
    for o in again.outcomes:
        if o.pushed_to:
            tag = tag_for(o.name, o.fingerprint)
            assert o.pushed_to == remote.ref.tag_ref(tag)
            entry = artifact.read_entry(remote.registry, tag)
            assert entry.config["fingerprint"] == o.fingerprint and entry.config["step"] == o.name
            assert entry.config["files"] == read_manifest(o.out_dir)["files"]
    CALLS.clear()
    fresh = build(recipe_file, tmp_path / "b")  # and another runner pulls them
    assert [o.name for o in fresh.outcomes if o.status.value == "pulled"] == ["quantize", "evaluate", "engine", "package"]


def test_an_authenticated_registry_takes_the_usual_credentials_and_never_shows_them(tmp_path, monkeypatch):
    secret = "Fast-Sentinel-93ac"
    reg = start_registry(tmp_path / "auth", auth=("kiln", secret))
    try:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"name: pipe\ntarget: reference\ncache:\n  remote: {reg.url('team/c')}\n")
        for name in ("KILN_REGISTRY_USERNAME", "KILN_REGISTRY_PASSWORD"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "nowhere"))
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "nowhere.json"))
        console, text = recorder()
        anonymous = build(recipe, tmp_path / "anon", console=console)
        assert anonymous.failure is None and "needs credentials and none were found" in text.getvalue()
        monkeypatch.setenv("KILN_REGISTRY_USERNAME", "kiln")
        monkeypatch.setenv("KILN_REGISTRY_PASSWORD", secret + "-wrong")
        console, wrong_text = recorder()
        wrong = build(recipe, tmp_path / "wrong", required=True, console=console)
        assert "refused credentials for 'kiln' from KILN_REGISTRY_USERNAME/KILN_REGISTRY_PASSWORD" in str(wrong.failure)
        monkeypatch.setenv("KILN_REGISTRY_PASSWORD", secret)
        console, ok_text = recorder()
        a = build(recipe, tmp_path / "a", console=console)
        assert {o.name for o in a.outcomes if o.pushed_to} == {"quantize", "evaluate", "engine", "package"}
        b = build(recipe, tmp_path / "b", console=console)
        assert statuses(b)["quantize"] == "pulled"
    finally:
        reg.stop()
    # every secret this test sent (the wrong one too), raw and as Basic sends it
    forms = [form for sent in (secret, secret + "-wrong")
             for form in (sent, base64.b64encode(f"kiln:{sent}".encode()).decode(),
                          base64.b64encode(sent.encode()).decode())]
    for blob in (text.getvalue(), wrong_text.getvalue(), ok_text.getvalue(), str(wrong.failure)):
        assert not any(f in blob for f in forms)
    for path in [*tmp_path.rglob("manifest.json"), *reg.storage.rglob("data")]:
        assert not any(f.encode() in path.read_bytes() for f in forms), path


def test_cache_ls_push_pull_and_gc_for_people(recipe_file, tmp_path, kiln):
    from kiln.pipeline.cache_ops import gc_entries, list_entries, pull_outputs, push_outputs

    build(recipe_file, tmp_path / "a", "cache.push=false")
    loaded = load_recipe(recipe_file)
    quiet = Console(file=open(os.devnull, "w"))
    remote = RemoteCache.for_recipe(loaded, required=True, console=quiet, progress=False)
    layout_a = runner.Layout(tmp_path / "a" / "build", tmp_path / "a" / "repo")
    assert list_entries(remote) == []
    pushed = push_outputs(loaded, layout_a, remote)
    assert [line.split(":")[0] for line in pushed] == ["quantize", "evaluate", "engine", "package"]
    rows = list_entries(remote, loaded, layout_a)
    assert {(r.step, r.current, r.recipe) for r in rows} == {(s, True, "pipe") for s in ("quantize", "evaluate",
                                                                                         "engine", "package")}
    layout_b = runner.Layout(tmp_path / "b" / "build", tmp_path / "b" / "repo")
    lines = pull_outputs(loaded, layout_b, remote, ("quantize",))
    assert lines == [f"quantize: pulled into {layout_b.build_root / 'pipe' / 'quantize'}"]
    assert read_manifest(layout_b.build_root / "pipe" / "quantize", ("out.txt",))["pulled"]
    with pytest.raises(Exception, match="not in the remote cache: resolve"):
        pull_outputs(loaded, layout_b, remote, ("resolve",))
    assert gc_entries(remote, 1.0)[0] == []  # nothing is a day old
    doomed, note = gc_entries(remote, 0.0, dry_run=True)
    assert len(doomed) == 4 and len(list_entries(remote)) == 4 and "garbage" in note
    result = kiln("cache", "gc", "--older-than", "0", "--cache", loaded.recipe.cache.remote)
    assert result.exit_code == 0 and "4 entries deleted" in result.output
    assert list_entries(remote) == []


def test_the_package_entry_is_the_digest_its_deploy_files_were_given(recipe_file, tmp_path, monkeypatch):
    """The finish hook (the package step's deploy files) gets the entry by a digest computed before any push; the
    push makes that digest exist, also when another build of the fingerprint holds the tag; a pull names the
    pulled entry's digest."""
    import dataclasses

    seen = []
    monkeypatch.setitem(SPECS, "package", dataclasses.replace(SPECS["package"],
                                                              finish=lambda loaded, out, src: seen.append(src)))
    remote = RemoteCache.for_recipe(load_recipe(recipe_file), progress=False)
    a = build(recipe_file, tmp_path / "a")
    first = seen[-1]
    assert remote.registry.get_manifest(first.tag)[1] == first.digest
    b = build(recipe_file, tmp_path / "b", "cache.pull=false")  # built again: another start time, another digest
    second = seen[-1]
    assert second.tag == first.tag and second.digest != first.digest
    package = next(o for o in b.outcomes if o.name == "package")
    assert package.pushed_to.endswith("@" + second.digest)
    assert remote.registry.get_manifest(second.digest)[1] == second.digest
    assert remote.registry.get_manifest(first.tag)[1] == first.digest  # the tag stays where it was
    c = build(recipe_file, tmp_path / "c")
    assert statuses(c)["package"] == "pulled" and seen[-1].digest == first.digest
    assert a.failure is None and b.failure is None and c.failure is None


def test_an_unchanged_output_is_not_read_again_to_name_its_digest(tmp_path, monkeypatch):
    """With a remote cache every build names the package entry by digest: the parts of files whose size, mtime,
    inode and mode are unchanged come from the memo (nothing read), a changed file is hashed again, and the digest
    is always the one a full read gives."""
    from kiln.util.artifacts import write_manifest

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.bin").write_bytes(os.urandom(3000))
    (out / "sub" / "b.txt").write_text("bee" * 100)
    (out / "empty").write_bytes(b"")
    write_manifest(out, {"step": "package"})
    manifest = read_manifest(out)
    for f in out.rglob("*"):  # written long enough ago to be remembered (a fresh file is always read)
        os.utime(f, ns=(10**18, 10**18))
    opened: list[str] = []
    real_open = open

    def counting_open(path, *a, **k):
        opened.append(Path(path).name)
        return real_open(path, *a, **k)

    monkeypatch.setattr(artifact, "open", counting_open, raising=False)

    def predict(memo=None) -> str:
        return artifact.predict_digest(out, manifest, 1024, {"k": "v"}, "2026-12-01T00:00:00+00:00", memo=memo)

    store = tmp_path / "memo"
    full = predict()
    assert sorted(opened) == ["a.bin", "b.txt", "empty"]
    opened.clear()
    assert predict(artifact.PartMemo(out, store)) == full and len(opened) == 3  # first time: read, remembered
    opened.clear()
    assert predict(artifact.PartMemo(out, store)) == full and opened == []  # unchanged: nothing read
    (out / "sub" / "b.txt").write_text("BEE" * 100)  # same size, new content: just modified, read every time
    changed = predict(artifact.PartMemo(out, store))
    assert opened == ["b.txt"] and changed != full and changed == predict()
    opened.clear()
    assert predict(artifact.PartMemo(out, store)) == changed and opened == ["b.txt"]  # still racy: not remembered
    os.utime(out / "sub" / "b.txt", ns=(10**18 + 5, 10**18 + 5))
    opened.clear()
    predict(artifact.PartMemo(out, store))
    assert opened == ["b.txt"]  # a new stamp: read once, remembered
    opened.clear()
    assert predict(artifact.PartMemo(out, store)) == changed and opened == []
    next(store.glob("*.json")).write_text("{not json")  # a broken memo costs a re-read, never a wrong digest
    assert predict(artifact.PartMemo(out, store)) == changed and len(opened) == 3
