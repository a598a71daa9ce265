"""Hostile remote-cache entries: what a registry (or whoever can push to it) may make kiln write.

Each entry below is a sound kiln entry with one thing wrong: a layer title that escapes (``..``, absolute, empty
segments), a reserved name, a part repeated, overlapping or missing, sizes that do not add up, a file that is
also a directory, a config listing other files or not written by kiln, annotations that lie, an oversized
manifest. Each is refused with a warning naming what is wrong, nothing is written outside the step's temporary
directory, and the step is built here (or the build fails under ``--cache-required``).

Two tiers: kiln's artifact code against an in-memory registry (a stand-in, named as one: it stores bytes and
serves them, nothing more) for every case, and the real ``docker-registry`` with each entry pushed by a raw OCI
client (``registry_harness.raw_push``, no kiln code) for the runner's whole path.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Callable, Optional

import pytest
from registry_harness import raw_push, registry_binary, start_registry
from rich.console import Console

from kiln.cache import artifact, registry as registry_module
from kiln.cache.errors import BadArtifact, DigestMismatch
from kiln.cache.reference import parse_cache_url
from kiln.pipeline import runner
from kiln.pipeline.remote import RemoteCache, tag_for
from kiln.recipe.loader import load_recipe
from kiln.util.artifacts import file_sizes, read_manifest

Mutation = Callable[[dict, dict], Optional[bytes]]
"""Edits an entry's OCI manifest and step manifest (config) in place; may return the config's raw bytes."""


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer_of(manifest: dict, path: str, index: int = 0) -> dict:
    """The ``index``-th part (by offset) of file ``path``."""
    parts = [layer for layer in manifest["layers"] if layer["annotations"][artifact.TITLE] == path]
    return sorted(parts, key=lambda layer: int(layer["annotations"][artifact.A_OFFSET]))[index]


def _extra_file(title: str) -> Mutation:
    """A layer carrying ``out.txt``'s bytes under ``title``, listed in the config too (so only the title is wrong:
    with the title check gone, the entry would pass every other check and the pull would write ``title``)."""

    def mutate(manifest: dict, config: dict) -> None:
        layer = json.loads(json.dumps(_layer_of(manifest, "out.txt")))
        layer["annotations"][artifact.TITLE] = title
        manifest["layers"].append(layer)
        config["files"][title] = layer["size"]
        manifest["annotations"][artifact.A_FILES] = str(len(config["files"]))
        manifest["annotations"][artifact.A_BYTES] = str(sum(x["size"] for x in manifest["layers"]))

    return mutate


def _second_part(key: str, change: Callable[[int], int]) -> Mutation:
    """Change annotation ``key`` of the second part of ``checkpoint/weights.bin``."""

    def mutate(manifest: dict, config: dict) -> None:
        ann = _layer_of(manifest, "checkpoint/weights.bin", 1)["annotations"]
        ann[key] = str(change(int(ann[key])))

    return mutate


def _duplicate(manifest: dict, config: dict) -> None:
    manifest["layers"].append(json.loads(json.dumps(_layer_of(manifest, "checkpoint/weights.bin", 1))))


def _grow_file(manifest: dict, config: dict) -> None:  # every part says the file is one byte longer
    for layer in manifest["layers"]:
        if layer["annotations"][artifact.TITLE] == "checkpoint/weights.bin":
            layer["annotations"][artifact.A_FILE_SIZE] = str(int(layer["annotations"][artifact.A_FILE_SIZE]) + 1)
    config["files"]["checkpoint/weights.bin"] += 1


def _config_lists_another_file(manifest: dict, config: dict) -> None:
    config["files"]["checkpoint/other.bin"] = 5


def _config_not_kilns(manifest: dict, config: dict) -> bytes:
    return json.dumps(config).encode()  # the same content, not the bytes kiln writes


def _config_media(manifest: dict, config: dict) -> None:
    manifest["config"]["mediaType"] = "application/vnd.oci.image.config.v1+json"


def _annotations_lie(manifest: dict, config: dict) -> None:
    manifest["annotations"][artifact.A_BYTES] = str(int(manifest["annotations"][artifact.A_BYTES]) + 1)


HOSTILE: dict[str, tuple[Mutation, str]] = {
    "dotdot": (_extra_file("../../../escaped.txt"), "is not a plain relative path"),
    "dotdot-inside": (_extra_file("checkpoint/../../escaped.txt"), "is not a plain relative path"),
    "absolute": (_extra_file("/tmp/kiln-hostile-absolute.txt"), "is not a plain relative path"),
    "empty-segment": (_extra_file("checkpoint//x.txt"), "is not a plain relative path"),
    "dot-segment": (_extra_file("./x.txt"), "is not a plain relative path"),
    "backslash": (_extra_file("..\\escaped.txt"), "no usable file name"),
    "reserved": (_extra_file("manifest.json"), "is reserved for kiln's own step manifest"),
    "reserved-nested": (_extra_file("checkpoint/manifest.json"), "is reserved for kiln's own step manifest"),
    "reserved-part": (_extra_file("manifest.json.part"), "is reserved for kiln's own step manifest"),
    "file-and-directory": (_extra_file("out.txt/inner.txt"), "is both a file and the directory of"),
    "duplicate-part": (_duplicate, "two layers carry the same part of a file"),
    "overlap": (_second_part(artifact.A_OFFSET, lambda n: n - 24), "overlap, repeat or leave a gap"),
    "gap": (_second_part(artifact.A_OFFSET, lambda n: n + 76), "overlap, repeat or leave a gap"),
    "negative-offset": (_second_part(artifact.A_OFFSET, lambda n: -n), "is negative"),
    "sizes-disagree": (_second_part(artifact.A_FILE_SIZE, lambda n: n - 1), "disagree about its size"),
    "sizes-do-not-add-up": (_grow_file, "do not add up to its size"),
    "config-lists-other-files": (_config_lists_another_file, "do not hold exactly the files the step manifest lists"),
    "config-not-kilns": (_config_not_kilns, "is not one kiln wrote"),
    "config-media-type": (_config_media, "unexpected config"),
    "annotations-lie": (_annotations_lie, "its annotations say"),
}
ESCAPES = {"dotdot": "../../../escaped.txt", "dotdot-inside": "checkpoint/../../escaped.txt",
           "absolute": "/tmp/kiln-hostile-absolute.txt"}


def _output(root: Path) -> dict:
    """A step output as kiln leaves it: three files (one of several parts at 1 KiB layers, one empty)."""
    (root / "checkpoint").mkdir(parents=True)
    (root / "out.txt").write_text("quantize output")
    (root / "checkpoint" / "weights.bin").write_bytes(bytes(range(256)) * 11 + bytes(184))  # 3000 bytes
    (root / "checkpoint" / "empty").write_bytes(b"")
    return {"step": "quantize", "complete": True, "fingerprint": "f" * 64, "files": file_sizes(root)}


def _forge(manifest: dict, config: dict, mutate: Mutation) -> tuple[bytes, bytes]:
    """The mutated entry as (manifest bytes, config bytes), the config descriptor pointing at the new config."""
    manifest, config = json.loads(json.dumps(manifest)), json.loads(json.dumps(config))
    raw = mutate(manifest, config)
    config_raw = raw if raw is not None else artifact.config_bytes(config)
    manifest["config"].update(digest=_sha(config_raw), size=len(config_raw))
    return json.dumps(manifest, sort_keys=True).encode(), config_raw


# ------------------------------------------------------------------------------------------ unit tier


class MemoryRegistry:
    """A stand-in registry (named as one): blobs and tagged manifests in dicts, with the methods kiln's artifact
    code calls on :class:`kiln.cache.registry.Registry`. It checks nothing; kiln's code must."""

    def __init__(self):
        self.ref = parse_cache_url("oci+http://memory.invalid/kiln-cache")
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[str, bytes] = {}

    def blob_exists(self, digest: str) -> bool:
        return digest in self.blobs

    def put_blob(self, digest, size, open_body, on_bytes=None) -> None:
        fh = open_body()
        self.blobs[digest] = fh.read(size)
        getattr(fh, "close", lambda: None)()

    def put_manifest(self, tag: str, body: bytes) -> str:
        self.manifests[tag] = body
        return _sha(body)

    def get_manifest(self, reference: str):
        body = self.manifests.get(reference)
        return None if body is None else (body, _sha(body))

    def fetch_blob(self, digest, size, sink, on_bytes=None) -> None:
        data = self.blobs[digest]
        sink.write(data)
        if _sha(data) != digest or len(data) != size:
            raise DigestMismatch(f"blob {digest} is corrupt", digest)


@pytest.fixture
def sound(tmp_path):
    """A sound entry pushed by kiln into the in-memory stand-in: (registry, manifest, config)."""
    reg = MemoryRegistry()
    step_manifest = _output(tmp_path / "out")
    artifact.push(reg, "t", tmp_path / "out", step_manifest, 1024, {})
    manifest = json.loads(reg.manifests["t"])
    config = json.loads(reg.blobs[manifest["config"]["digest"]])
    return reg, manifest, config


def test_a_sound_entry_reads_and_pulls(sound, tmp_path):
    reg, manifest, _ = sound
    entry = artifact.read_entry(reg, "t")
    assert sorted((p.path, p.offset, p.size) for p in entry.parts) == [
        ("checkpoint/empty", 0, 0), ("checkpoint/weights.bin", 0, 1024), ("checkpoint/weights.bin", 1024, 1024),
        ("checkpoint/weights.bin", 2048, 952), ("out.txt", 0, 15)]
    (tmp_path / "dest").mkdir()
    artifact.pull(reg, entry, tmp_path / "dest")
    assert file_sizes(tmp_path / "dest") == file_sizes(tmp_path / "out")
    assert (tmp_path / "dest" / "checkpoint" / "weights.bin").read_bytes() == \
        (tmp_path / "out" / "checkpoint" / "weights.bin").read_bytes()


def test_a_pulled_file_is_never_writable_by_group_or_others(sound, tmp_path):
    """An entry may say 777 (or 4777): the pulled file keeps the owner's and the read/execute bits, never anyone
    else's write bit (a world-writable model.py is code any local user could change before tritonserver runs it)."""
    reg, manifest, config = sound

    def modes(m: dict, c: dict) -> None:
        for layer in m["layers"]:
            title = layer["annotations"]["org.opencontainers.image.title"]
            layer["annotations"]["dev.kiln.file.mode"] = "4777" if title == "out.txt" else "666"

    body, config_raw = _forge(manifest, config, modes)
    reg.blobs[_sha(config_raw)] = config_raw
    reg.manifests["t"] = body
    (tmp_path / "dest").mkdir()
    artifact.pull(reg, artifact.read_entry(reg, "t"), tmp_path / "dest")
    assert (tmp_path / "dest" / "out.txt").stat().st_mode & 0o7777 == 0o755
    assert (tmp_path / "dest" / "checkpoint" / "weights.bin").stat().st_mode & 0o7777 == 0o644


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_entry_is_refused_before_anything_is_written(sound, tmp_path, case):
    reg, manifest, config = sound
    mutate, message = HOSTILE[case]
    body, config_raw = _forge(manifest, config, mutate)
    reg.blobs[_sha(config_raw)] = config_raw
    reg.manifests["t"] = body
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(BadArtifact, match="memory.invalid/kiln-cache:t") as refused:
        artifact.read_entry(reg, "t")
    assert message in str(refused.value)
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert not Path("/tmp/kiln-hostile-absolute.txt").exists()


def test_a_pull_never_writes_outside_its_directory_even_for_parts_that_were_not_checked(sound, tmp_path):
    """Defence in depth: :func:`artifact.pull` itself refuses a part whose path leaves the directory, and never
    writes through a link or over a file it did not create."""
    reg, _, _ = sound
    entry = artifact.read_entry(reg, "t")
    good = next(p for p in entry.parts if p.path == "out.txt")
    dest = tmp_path / "a" / "dest"
    dest.mkdir(parents=True)
    for title in ("../escaped.txt", "/tmp/kiln-hostile-absolute.txt", "."):
        entry.parts = [artifact.Part(title, 0, good.size, good.file_size, good.digest)]
        with pytest.raises(BadArtifact, match="resolves outside"):
            artifact.pull(reg, entry, dest)
    assert not (tmp_path / "a" / "escaped.txt").exists() and not Path("/tmp/kiln-hostile-absolute.txt").exists()
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (dest / "link.txt").symlink_to(victim)
    entry.parts = [artifact.Part("link.txt", 0, good.size, good.file_size, good.digest)]
    with pytest.raises(BadArtifact, match="resolves outside"):  # a link leading out
        artifact.pull(reg, entry, dest)
    (dest / "inside.txt").write_text("mine")
    (dest / "link.txt").unlink()
    (dest / "link.txt").symlink_to(dest / "inside.txt")
    with pytest.raises(FileExistsError):  # a link inside, or any file already there: never written through
        artifact.pull(reg, entry, dest)
    assert victim.read_text() == "mine" and (dest / "inside.txt").read_text() == "mine"


# ------------------------------------------------------------------------------------------ the real registry

needs_registry = pytest.mark.skipif(registry_binary() is None, reason="docker-registry is not installed "
                                    "(apt-get install docker-registry; .ci/run does)")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The real registry, and a stand-in pipeline's quantize output built once (no remote): what a hostile entry
    is forged from, and the fingerprint a build looks up."""
    from tests.test_remote_cache import SPECS

    if registry_binary() is None:
        pytest.skip("docker-registry is not installed")
    reg = start_registry(tmp_path_factory.mktemp("hostile-registry"))
    root = tmp_path_factory.mktemp("hostile-a")
    recipe = root / "r.yaml"
    recipe.write_text("name: pipe\ntarget: reference\nquantization:\n  format: int8_sq\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "load_steps", lambda: dict(SPECS))
        layout = runner.Layout(root / "build", root / "repo")
        assert runner.run(load_recipe(recipe), layout, progress=False,
                          console=Console(file=io.StringIO())).failure is None
        quantize = next(p for p in runner.schedule(load_recipe(recipe), layout) if p.spec.name == "quantize")
    out = quantize.out_dir
    step_manifest = read_manifest(out)
    parts = artifact.plan_parts(out, step_manifest["files"], 1 << 20)
    blobs = {p.digest: _read(out / p.path, p.offset, p.size) for p in parts}
    config = json.loads(artifact.config_bytes(step_manifest))
    manifest = {"schemaVersion": 2, "mediaType": registry_module.OCI_MANIFEST, "artifactType": artifact.ARTIFACT_TYPE,
                "config": {"mediaType": artifact.CONFIG_MEDIA, "digest": "", "size": 0},
                "layers": [p.descriptor() for p in parts],
                "annotations": {artifact.A_FINGERPRINT: quantize.fingerprint, artifact.A_STEP: "quantize",
                                artifact.A_BYTES: str(sum(p.size for p in parts)),
                                artifact.A_FILES: str(len(step_manifest["files"]))}}
    yield reg, quantize.fingerprint, manifest, config, list(blobs.values())
    reg.stop()


def _read(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(size)


def _build_against(real, tmp_path: Path, repository: str, required: bool = False, push: bool = False):
    from tests.test_remote_cache import SPECS

    reg = real[0]
    tmp_path.mkdir(parents=True, exist_ok=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: pipe\ntarget: reference\nquantization:\n  format: int8_sq\n"
                      f"cache:\n  remote: {reg.url(repository)}\n  share: [quantize]\n  push: {str(push).lower()}\n")
    text = io.StringIO()
    console = Console(file=text, width=400)
    loaded = load_recipe(recipe)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "load_steps", lambda: dict(SPECS))
        remote = RemoteCache.for_recipe(loaded, required=required, console=console, progress=False)
        summary = runner.run(loaded, runner.Layout(tmp_path / "b" / "build", tmp_path / "b" / "repo"),
                             to_step="quantize", progress=False, console=console, remote=remote)
    return summary, text.getvalue()


REAL_CASES = list(HOSTILE)


@needs_registry
def test_hostile_entries_pushed_by_a_raw_client_are_refused_and_built_here(real, tmp_path, monkeypatch):
    from tests.test_remote_cache import SPECS

    monkeypatch.setattr(runner, "load_steps", lambda: dict(SPECS))
    reg, fingerprint, manifest, config, blobs = real
    tag = tag_for("quantize", fingerprint)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: pipe\ntarget: reference\nquantization:\n  format: int8_sq\n")
    loaded = load_recipe(recipe)
    step = next(p for p in runner.schedule(loaded, runner.Layout(tmp_path / "build")) if p.spec.name == "quantize")
    assert step.fingerprint == fingerprint
    # The forge itself is sound: unmutated, the entry pulls.
    sound_body, sound_config = _forge(manifest, config, lambda m, c: None)
    assert raw_push(reg.host, "hostile/sound", tag, sound_body, [*blobs, sound_config]).status_code == 201
    (tmp_path / "sound").mkdir()
    assert RemoteCache(reg.url("hostile/sound"), loaded.recipe.cache, console=Console(file=io.StringIO()),
                       progress=False).pull(step, tmp_path / "sound", loaded) is not None
    # Every case through the remote cache's pull, as the runner calls it, into an empty temporary directory.
    for case in REAL_CASES:
        mutate, message = HOSTILE[case]
        body, config_raw = _forge(manifest, config, mutate)
        stored = raw_push(reg.host, "hostile/sound", tag, body, [*blobs, config_raw])  # the tag, overwritten
        assert stored.status_code == 201, (case, stored.text)
        text = io.StringIO()
        remote = RemoteCache(reg.url("hostile/sound"), loaded.recipe.cache, console=Console(file=text, width=400),
                             progress=False)
        tmp = tmp_path / case / "build" / "pipe" / ".quantize.tmp"
        tmp.mkdir(parents=True)
        assert remote.pull(step, tmp, loaded) is None, case
        assert message in text.getvalue() and "building it here" in text.getvalue(), (case, text.getvalue())
        assert list(tmp.iterdir()) == [], case
        assert [p for p in tmp_path.rglob("escaped.txt")] == [], case
        assert not Path("/tmp/kiln-hostile-absolute.txt").exists(), case
        if case == "dotdot":
            assert raw_push(reg.host, "hostile/dotdot", tag, body, [*blobs, config_raw]).status_code == 201
    # The whole runner on the escaping entry: warned, built here, nothing written outside; and refused outright
    # under --cache-required.
    summary, log = _build_against(real, tmp_path / "build-here", "hostile/dotdot")
    assert summary.failure is None and {o.name: o.status.value for o in summary.outcomes}["quantize"] == "ran"
    assert "is not a plain relative path" in log and "building it here" in log
    quantize = tmp_path / "build-here" / "b" / "build" / "pipe" / "quantize"
    assert "pulled" not in read_manifest(quantize)
    assert [p for p in tmp_path.rglob("escaped.txt")] == []
    assert [p.name for p in quantize.parent.iterdir() if ".tmp" in p.name] == []
    # With push on, the output built here replaces the refused entry, and the next runner pulls it.
    summary, log = _build_against(real, tmp_path / "heal", "hostile/dotdot", push=True)
    assert {o.name: o.status.value for o in summary.outcomes}["quantize"] == "ran"
    assert "building it here and pushing it over that entry" in log
    assert [o.name for o in summary.outcomes if o.pushed_to] == ["quantize"]
    summary, log = _build_against(real, tmp_path / "healed", "hostile/dotdot")
    assert {o.name: o.status.value for o in summary.outcomes}["quantize"] == "pulled", log
    hostile_body, hostile_config = _forge(manifest, config, HOSTILE["dotdot"][0])  # the hostile entry again
    assert raw_push(reg.host, "hostile/dotdot", tag, hostile_body, [*blobs, hostile_config]).status_code == 201
    required, _ = _build_against(real, tmp_path / "required", "hostile/dotdot", required=True)
    assert required.failure is not None and "--cache-required" in str(required.failure)
    assert "is not a plain relative path" in str(required.failure)
    assert read_manifest(tmp_path / "required" / "b" / "build" / "pipe" / "quantize") is None


@needs_registry
def test_an_oversized_manifest_is_refused_without_reading_it_whole(real, tmp_path, monkeypatch):
    """distribution stores manifests up to 4 MiB, kiln's limit too; with the limit lowered to 64 KiB for the
    test, a 100 KiB manifest in the real registry is refused and the step built here."""
    reg, fingerprint, manifest, config, blobs = real
    monkeypatch.setattr(registry_module, "MAX_MANIFEST", 64 << 10)
    padded = json.loads(json.dumps(manifest))
    padded["annotations"]["dev.kiln.padding"] = "x" * (100 << 10)
    body, config_raw = _forge(padded, config, lambda m, c: None)
    assert raw_push(reg.host, "hostile/sound", tag_for("quantize", fingerprint), body,
                    [*blobs, config_raw]).status_code == 201
    summary, log = _build_against(real, tmp_path, "hostile/sound")
    assert {o.name: o.status.value for o in summary.outcomes}["quantize"] == "ran"
    assert f"is larger than {64 << 10} bytes" in log and "building it here" in log
