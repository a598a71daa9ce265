"""One step output ↔ one OCI artifact.

The artifact is an OCI image manifest (``artifactType`` :data:`ARTIFACT_TYPE`) whose config blob is the step's
``manifest.json`` (fingerprint, components, typed result, file sizes) and whose layers are the output's files,
uncompressed, each file cut into parts of at most ``layer_bytes`` (a layer per part; a part's annotations name
the file, its offset and the file's size). So a multi-GB engine pushes layer by layer: a push that is killed
resumes by skipping every layer the registry already has, and a pull checks every layer's sha256 as it streams.
The manifest's annotations repeat the step, fingerprint and recipe, so listings need not fetch configs.

Pushing writes blobs first and the tagged manifest last: a killed push leaves no entry a lookup finds. Pulling
writes into a directory the caller renames into place only after every layer verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Optional, Protocol

from kiln.cache.errors import BadArtifact
from kiln.cache.registry import CHUNK, OCI_MANIFEST, Registry, sha256_digest

ARTIFACT_TYPE = "application/vnd.kiln.step-output.v1"
CONFIG_MEDIA = "application/vnd.kiln.step-manifest.v1+json"
PART_MEDIA = "application/vnd.kiln.file-part.v1"
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
A_OFFSET, A_FILE_SIZE, A_MODE = "dev.kiln.file.offset", "dev.kiln.file.size", "dev.kiln.file.mode"
A_STEP, A_FINGERPRINT = "dev.kiln.step", "dev.kiln.fingerprint"
A_RECIPE, A_VERSION = "dev.kiln.recipe", "dev.kiln.version"
A_BYTES, A_FILES = "dev.kiln.bytes", "dev.kiln.files"
MANIFEST_NAME = "manifest.json"


class Meter(Protocol):
    """Progress of a transfer: a phase with its total bytes, then bytes as they move."""

    def phase(self, name: str, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


class NullMeter:
    def phase(self, name: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


@dataclass(frozen=True)
class Part:
    """One layer: ``size`` bytes of file ``path`` from ``offset``."""

    path: str
    offset: int
    size: int
    file_size: int
    digest: str
    mode: int = 0o644

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": PART_MEDIA, "digest": self.digest, "size": self.size,
                "annotations": {TITLE: self.path, A_OFFSET: str(self.offset), A_FILE_SIZE: str(self.file_size),
                                A_MODE: f"{self.mode:o}"}}


@dataclass
class Transfer:
    """What a push or pull moved."""

    layers: int = 0
    layers_skipped: int = 0
    bytes_moved: int = 0
    bytes_skipped: int = 0
    seconds: float = 0.0
    digest: str = ""
    """The manifest's digest."""

    @property
    def rate_mb_s(self) -> float:
        return self.bytes_moved / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def describe(self, verb: str) -> str:
        text = f"{verb} {_size(self.bytes_moved)} in {self.layers - self.layers_skipped} layer(s), {self.seconds:.1f}s"
        if self.bytes_moved >= 1e6 and self.seconds > 0:
            text += f" ({self.rate_mb_s:.0f} MB/s)"
        if self.layers_skipped:
            text += f"; {self.layers_skipped} layer(s), {_size(self.bytes_skipped)} already in the registry"
        return text


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


@dataclass
class Entry:
    """A cache entry as the registry holds it: the OCI manifest, its digest, and the step manifest (config)."""

    tag: str
    digest: str
    manifest: dict[str, Any]
    config: dict[str, Any]
    parts: list[Part] = field(default_factory=list)

    @property
    def annotations(self) -> dict[str, str]:
        return dict(self.manifest.get("annotations") or {})

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


def plan_parts(root: Path, files: dict[str, int], layer_bytes: int, meter: Meter = NullMeter()) -> list[Part]:
    """Cut every listed file into parts of at most ``layer_bytes`` and hash each (reading every byte once)."""
    if layer_bytes < 1:
        raise ValueError("layer_bytes must be positive")
    meter.phase("hashing", sum(files.values()))
    parts: list[Part] = []
    for rel in sorted(files):
        path = root / rel
        size = path.stat().st_size
        if size != files[rel]:
            raise BadArtifact(f"{path} is {size} bytes, its manifest says {files[rel]}: the output changed")
        mode = path.stat().st_mode & 0o777
        with open(path, "rb") as fh:
            offset = 0
            while offset < size or (size == 0 and offset == 0):
                n = min(layer_bytes, size - offset)
                h, left = hashlib.sha256(), n
                while left:
                    block = fh.read(min(CHUNK, left))
                    if not block:
                        raise BadArtifact(f"{path} shrank while it was read")
                    h.update(block)
                    left -= len(block)
                    meter.advance(len(block))
                parts.append(Part(rel, offset, n, size, "sha256:" + h.hexdigest(), mode))
                offset += n
                if size == 0:
                    break
    return parts


def _complete_files(root: Path, step_manifest: dict[str, Any]) -> dict[str, int]:
    files = step_manifest.get("files")
    if not isinstance(files, dict) or step_manifest.get("complete") is not True:
        raise BadArtifact(f"{root} is not a complete output (its manifest lists no files or is not complete)")
    return files


def _config_bytes(step_manifest: dict[str, Any]) -> bytes:
    return json.dumps(step_manifest, indent=2, sort_keys=True, default=str).encode()


def _manifest_bytes(parts: list[Part], config: bytes, files: int, annotations: dict[str, str],
                    created: Optional[str]) -> bytes:
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA, "digest": sha256_digest(config), "size": len(config)},
        "layers": [p.descriptor() for p in parts],
        "annotations": {**annotations, CREATED: created or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        A_BYTES: str(sum(p.size for p in parts)), A_FILES: str(files)},
    }
    return json.dumps(manifest, sort_keys=True).encode()


def predict_digest(root: Path, step_manifest: dict[str, Any], layer_bytes: int, annotations: dict[str, str],
                   created: str, meter: Meter = NullMeter()) -> str:
    """The manifest digest :func:`push` gives this output with the same ``created`` time: a function of the
    content alone, so files written before any push (deploy files) can name the entry by digest."""
    files = _complete_files(root, step_manifest)
    parts = plan_parts(root, files, layer_bytes, meter)
    return sha256_digest(_manifest_bytes(parts, _config_bytes(step_manifest), len(files), annotations, created))


def push(reg: Registry, tag: str, root: Path, step_manifest: dict[str, Any], layer_bytes: int,
         annotations: dict[str, str], meter: Meter = NullMeter(), created: Optional[str] = None) -> Transfer:
    """Push the complete output in ``root`` (its files as listed in ``step_manifest``) under ``tag`` (a tag, or
    the manifest's own digest to add it without moving a tag). ``created``: the creation annotation (default
    now); give one to get the digest :func:`predict_digest` said."""
    t0 = time.monotonic()
    files = _complete_files(root, step_manifest)
    parts = plan_parts(root, files, layer_bytes, meter)
    report = Transfer(layers=len(parts))
    meter.phase("pushing", sum(p.size for p in parts))
    for part in parts:
        if reg.blob_exists(part.digest):
            report.layers_skipped += 1
            report.bytes_skipped += part.size
            meter.advance(part.size)
            continue

        def open_body(part: Part = part):
            fh = open(root / part.path, "rb")
            fh.seek(part.offset)
            return fh

        reg.put_blob(part.digest, part.size, open_body, meter.advance)
        report.bytes_moved += part.size
    config = _config_bytes(step_manifest)
    config_digest = sha256_digest(config)
    if not reg.blob_exists(config_digest):
        reg.put_blob(config_digest, len(config), lambda: _BytesFile(config))
    body = _manifest_bytes(parts, config, len(files), annotations, created)
    if tag.startswith("sha256:") and sha256_digest(body) != tag:
        raise BadArtifact(f"{root}: its manifest hashes to {sha256_digest(body)}, not {tag}: the output changed")
    report.digest = reg.put_manifest(tag, body)
    report.seconds = time.monotonic() - t0
    return report


class _BytesFile:
    def __init__(self, data: bytes):
        self._data, self._pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n < 0 else self._pos + n
        block, self._pos = self._data[self._pos:end], min(end, len(self._data))
        return block


def read_entry(reg: Registry, tag: str) -> Optional[Entry]:
    """The entry tagged ``tag`` with its config fetched and verified, and its layers checked to describe whole
    files; None when there is no such tag. BadArtifact / DigestMismatch when it is not a sound kiln entry."""
    found = reg.get_manifest(tag)
    if found is None:
        return None
    body, digest = found
    try:
        manifest = json.loads(body)
    except ValueError:
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the manifest is not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("artifactType") != ARTIFACT_TYPE:
        raise BadArtifact(f"{reg.ref.tag_ref(tag)} is not a kiln step output (artifactType "
                          f"{manifest.get('artifactType') if isinstance(manifest, dict) else None!r})")
    cfg = manifest.get("config") or {}
    if cfg.get("mediaType") != CONFIG_MEDIA or not isinstance(cfg.get("size"), int) or cfg["size"] > 64 << 20:
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: unexpected config {cfg.get('mediaType')!r}")
    sink = _Sink()
    reg.fetch_blob(str(cfg.get("digest")), cfg["size"], sink)
    try:
        config = json.loads(bytes(sink.data))
    except ValueError:
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the step manifest is not JSON") from None
    if not isinstance(config, dict):
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the step manifest is not an object")
    entry = Entry(tag, digest, manifest, config)
    entry.parts = _parts(manifest, config, reg.ref.tag_ref(tag))
    return entry


class _Sink:
    def __init__(self):
        self.data = bytearray()

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)


def _safe_rel(title: object, where: str) -> str:
    if not isinstance(title, str) or not title or "\\" in title or "\0" in title:
        raise BadArtifact(f"{where}: a layer has no usable file name")
    path = PurePosixPath(title)
    if path.is_absolute() or any(part in ("", ".", "..") for part in path.parts) or str(path) != title \
            or title == MANIFEST_NAME:
        raise BadArtifact(f"{where}: layer file name {title!r} is not a plain relative path")
    return title


def _parts(manifest: dict, config: dict, where: str) -> list[Part]:
    parts: list[Part] = []
    for layer in manifest.get("layers") or []:
        ann = layer.get("annotations") or {}
        try:
            part = Part(_safe_rel(ann.get(TITLE), where), int(ann[A_OFFSET]), int(layer["size"]),
                        int(ann[A_FILE_SIZE]), str(layer["digest"]), int(ann.get(A_MODE, "644"), 8) & 0o777)
        except (KeyError, TypeError, ValueError):
            raise BadArtifact(f"{where}: a layer lacks its file name, offset or size") from None
        if layer.get("mediaType") != PART_MEDIA or not part.digest.startswith("sha256:"):
            raise BadArtifact(f"{where}: layer {part.digest} is not a kiln file part")
        parts.append(part)
    covered: dict[str, int] = {}
    for part in sorted(parts, key=lambda p: (p.path, p.offset)):
        if part.offset != covered.get(part.path, 0):
            raise BadArtifact(f"{where}: the layers of {part.path} do not cover it contiguously")
        covered[part.path] = part.offset + part.size
    sizes = {p.path: p.file_size for p in parts}
    if any(covered[path] != sizes[path] for path in covered):
        raise BadArtifact(f"{where}: the layers of a file do not add up to its size")
    if config.get("files") != sizes:
        raise BadArtifact(f"{where}: the layers do not hold exactly the files the step manifest lists")
    return parts


def pull(reg: Registry, entry: Entry, dest: Path, meter: Meter = NullMeter()) -> Transfer:
    """Write the entry's files under ``dest`` (an empty directory the caller renames into place), checking
    every layer's sha256 as it streams. DigestMismatch on the first corrupt layer (files then incomplete)."""
    t0 = time.monotonic()
    report = Transfer(layers=len(entry.parts), digest=entry.digest)
    meter.phase("pulling", entry.size)
    ordered = sorted(entry.parts, key=lambda p: (p.path, p.offset))
    current, fh = None, None
    try:
        for part in ordered:
            if part.path != current:
                if fh is not None:
                    fh.close()
                target = dest / part.path
                target.parent.mkdir(parents=True, exist_ok=True)
                fh, current = open(target, "wb"), part.path
                os.chmod(target, part.mode | 0o600)
            if part.size == 0:
                continue
            reg.fetch_blob(part.digest, part.size, fh, meter.advance)
            report.bytes_moved += part.size
    finally:
        if fh is not None:
            fh.close()
    report.seconds = time.monotonic() - t0
    return report
