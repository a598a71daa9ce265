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
from kiln.util.paths import cache_root

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
PULLED_MODE_MASK = 0o755
"""The most a pulled file's mode may be: an entry's group/other write bits are dropped."""
MAX_CONFIG_BYTES = 16 << 20


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


RACY_S = 2
"""A file modified this recently (seconds) is hashed every time, never taken from the memo."""


class PartMemo:
    """The parts :func:`plan_parts` hashed before in one output folder, kept in kiln's cache folder
    (``part-hashes/``): a file's parts are reused while its size, modification time (ns), inode, device and mode
    are what they were when it was hashed (the check make and git's index make), so a build with a remote cache
    names an unchanged repository's entry by digest without reading it again, and the push after a prediction
    does not hash it twice. A memo that cannot be read or written only costs a re-read."""

    def __init__(self, root: Path, store: Optional[Path] = None) -> None:
        key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:32]
        self.file = (store if store is not None else cache_root() / "part-hashes") / f"{key}.json"
        self.changed = False
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
            self.entries: dict[str, Any] = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            self.entries = {}

    @staticmethod
    def stamp(path: Path, layer_bytes: int) -> list[int]:
        st = path.stat()
        return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_mode & 0o777, layer_bytes]

    def get(self, rel: str, stamp: list[int]) -> Optional[list[Part]]:
        entry = self.entries.get(rel)
        if not isinstance(entry, dict) or entry.get("stamp") != stamp:
            return None
        try:
            return [Part(rel, int(o), int(n), stamp[0], str(d), stamp[4]) for o, n, d in entry["parts"]]
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, rel: str, stamp: list[int], parts: list[Part]) -> None:
        self.entries[rel] = {"stamp": stamp, "parts": [[p.offset, p.size, p.digest] for p in parts]}
        self.changed = True

    def save(self, keep: set[str]) -> None:
        """Write the memo (only the files in ``keep``: the output's files now) if it changed."""
        stale = set(self.entries) - keep
        if not (self.changed or stale):
            return
        data = {rel: e for rel, e in self.entries.items() if rel in keep}
        tmp = self.file.with_name(f".{self.file.name}.{os.getpid()}.tmp")
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.file)
        except OSError:
            tmp.unlink(missing_ok=True)


def plan_parts(root: Path, files: dict[str, int], layer_bytes: int, meter: Meter = NullMeter(),
               memo: Optional[PartMemo] = None) -> list[Part]:
    """Cut every listed file into parts of at most ``layer_bytes`` and hash each (reading every byte once; with
    ``memo``, only the files that changed since it last saw them)."""
    if layer_bytes < 1:
        raise ValueError("layer_bytes must be positive")
    meter.phase("hashing", sum(files.values()))
    parts: list[Part] = []
    for rel in sorted(files):
        path = root / rel
        stamp = PartMemo.stamp(path, layer_bytes)
        size, mode = stamp[0], stamp[4]
        if size != files[rel]:
            raise BadArtifact(f"{path} is {size} bytes, its manifest says {files[rel]}: the output changed")
        known = memo.get(rel, stamp) if memo is not None else None
        if known is not None:
            parts += known
            meter.advance(size)
            continue
        mine: list[Part] = []
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
                mine.append(Part(rel, offset, n, size, "sha256:" + h.hexdigest(), mode))
                offset += n
                if size == 0:
                    break
        # remembered only when unchanged while it was read and not modified in the last RACY_S seconds: a same-size
        # rewrite within one timestamp tick would keep the stamp (git's "racily clean" rule)
        if memo is not None and PartMemo.stamp(path, layer_bytes) == stamp \
                and time.time_ns() - stamp[1] > RACY_S * 1_000_000_000:
            memo.put(rel, stamp, mine)
        parts += mine
    if memo is not None:
        memo.save(set(files))
    return parts


def _complete_files(root: Path, step_manifest: dict[str, Any]) -> dict[str, int]:
    files = step_manifest.get("files")
    if not isinstance(files, dict) or step_manifest.get("complete") is not True:
        raise BadArtifact(f"{root} is not a complete output (its manifest lists no files or is not complete)")
    return files


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
                   created: str, meter: Meter = NullMeter(), memo: Optional[PartMemo] = None) -> str:
    """The manifest digest :func:`push` gives this output with the same ``created`` time: a function of the
    content alone, so files written before any push (deploy files) can name the entry by digest."""
    files = _complete_files(root, step_manifest)
    parts = plan_parts(root, files, layer_bytes, meter, memo)
    return sha256_digest(_manifest_bytes(parts, config_bytes(step_manifest), len(files), annotations, created))


def push(reg: Registry, tag: str, root: Path, step_manifest: dict[str, Any], layer_bytes: int,
         annotations: dict[str, str], meter: Meter = NullMeter(), created: Optional[str] = None,
         memo: Optional[PartMemo] = None) -> Transfer:
    """Push the complete output in ``root`` (its files as listed in ``step_manifest``) under ``tag`` (a tag, or
    the manifest's own digest to add it without moving a tag). ``created``: the creation annotation (default
    now); give one to get the digest :func:`predict_digest` said."""
    t0 = time.monotonic()
    files = _complete_files(root, step_manifest)
    parts = plan_parts(root, files, layer_bytes, meter, memo)
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
    config = config_bytes(step_manifest)
    config_digest = sha256_digest(config)
    if not reg.blob_exists(config_digest):
        reg.put_blob(config_digest, len(config), lambda: _BytesFile(config))
    body = _manifest_bytes(parts, config, len(files), annotations, created)
    if tag.startswith("sha256:") and sha256_digest(body) != tag:
        raise BadArtifact(f"{root}: its manifest hashes to {sha256_digest(body)}, not {tag}: the output changed")
    report.digest = reg.put_manifest(tag, body)
    report.seconds = time.monotonic() - t0
    return report


def config_bytes(step_manifest: dict[str, Any]) -> bytes:
    """The config blob kiln writes for a step manifest: its canonical JSON (a pull accepts no other bytes)."""
    return json.dumps(step_manifest, indent=2, sort_keys=True, default=str).encode()


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
    if not isinstance(cfg, dict) or cfg.get("mediaType") != CONFIG_MEDIA or not isinstance(cfg.get("size"), int) \
            or isinstance(cfg.get("size"), bool) or not 0 < cfg["size"] <= MAX_CONFIG_BYTES:
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: unexpected config "
                          f"{cfg.get('mediaType') if isinstance(cfg, dict) else cfg!r} (refused: kiln writes a "
                          f"{CONFIG_MEDIA} of at most {MAX_CONFIG_BYTES >> 20} MiB)")
    sink = _Sink()
    reg.fetch_blob(str(cfg.get("digest")), cfg["size"], sink)
    try:
        config = json.loads(bytes(sink.data))
    except ValueError:
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the step manifest is not JSON") from None
    if not isinstance(config, dict):
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the step manifest is not an object")
    if config_bytes(config) != bytes(sink.data):
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the step manifest is not one kiln wrote (not its canonical JSON; "
                          "refused)")
    files = config.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in files.values()):
        raise BadArtifact(f"{reg.ref.tag_ref(tag)}: the step manifest's files are not a map of sizes (refused)")
    entry = Entry(tag, digest, manifest, config)
    entry.parts = _parts(manifest, config, reg.ref.tag_ref(tag))
    return entry


class _Sink:
    def __init__(self):
        self.data = bytearray()

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)


RESERVED_NAMES = (MANIFEST_NAME, MANIFEST_NAME + ".part")
"""File names an entry may not carry at any depth: the step manifest kiln writes itself (and its temporary
name); kiln never pushes a file of that name (``file_sizes`` leaves every ``manifest.json`` out)."""
MAX_LAYERS = 100_000


def _safe_rel(title: object, where: str) -> str:
    """A layer's file name as a plain relative POSIX path, or BadArtifact: nothing absolute, no ``..``/``.``/empty
    segment, no backslash or NUL, no reserved name — so a pull writes only below its temporary directory."""
    if not isinstance(title, str) or not title or "\\" in title or "\0" in title:
        raise BadArtifact(f"{where}: a layer has no usable file name (refused)")
    path = PurePosixPath(title)
    if path.is_absolute() or any(part in ("", ".", "..") for part in title.split("/")) or str(path) != title:
        raise BadArtifact(f"{where}: layer file name {title!r} is not a plain relative path (refused: it could "
                          "write outside the step's directory)")
    if path.name in RESERVED_NAMES:
        raise BadArtifact(f"{where}: layer file name {title!r} is reserved for kiln's own step manifest (refused)")
    return title


def _count(value: object, what: str, where: str) -> int:
    """A non-negative integer from a manifest field (BadArtifact otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadArtifact(f"{where}: a layer's {what} is not a number (refused)")
    try:
        n = int(value)
    except ValueError:
        raise BadArtifact(f"{where}: a layer's {what} {value!r} is not a number (refused)") from None
    if n < 0:
        raise BadArtifact(f"{where}: a layer's {what} is negative ({n}) (refused)")
    return n


def _parts(manifest: dict, config: dict, where: str) -> list[Part]:
    layers = manifest.get("layers") or []
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise BadArtifact(f"{where}: the manifest's layers are not a list of at most {MAX_LAYERS} (refused)")
    parts: list[Part] = []
    for layer in layers:
        if not isinstance(layer, dict) or not isinstance(layer.get("annotations") or {}, dict):
            raise BadArtifact(f"{where}: a layer is not an OCI descriptor (refused)")
        ann = layer.get("annotations") or {}
        if TITLE not in ann or A_OFFSET not in ann or A_FILE_SIZE not in ann or "size" not in layer:
            raise BadArtifact(f"{where}: a layer lacks its file name, offset or size")
        try:
            mode = int(str(ann.get(A_MODE, "644")), 8) & 0o777
        except ValueError:
            raise BadArtifact(f"{where}: a layer's file mode {ann.get(A_MODE)!r} is not octal (refused)") from None
        part = Part(_safe_rel(ann[TITLE], where), _count(ann[A_OFFSET], "offset", where),
                    _count(layer["size"], "size", where), _count(ann[A_FILE_SIZE], "file size", where),
                    str(layer.get("digest")), mode)
        if layer.get("mediaType") != PART_MEDIA or not part.digest.startswith("sha256:"):
            raise BadArtifact(f"{where}: layer {part.digest} is not a kiln file part")
        parts.append(part)
    covered: dict[str, int] = {}
    sizes: dict[str, int] = {}
    if len({(p.path, p.offset) for p in parts}) != len(parts):
        raise BadArtifact(f"{where}: two layers carry the same part of a file (refused)")
    for part in sorted(parts, key=lambda p: (p.path, p.offset)):
        if sizes.setdefault(part.path, part.file_size) != part.file_size:
            raise BadArtifact(f"{where}: the layers of {part.path} disagree about its size (refused)")
        if part.offset != covered.get(part.path, 0):
            raise BadArtifact(f"{where}: the layers of {part.path} overlap, repeat or leave a gap (they must cover "
                              "it contiguously; refused)")
        if part.size == 0 and part.file_size != 0:
            raise BadArtifact(f"{where}: an empty layer of {part.path}, which is not empty (refused)")
        covered[part.path] = part.offset + part.size
    if any(covered[path] != sizes[path] for path in covered):
        raise BadArtifact(f"{where}: the layers of a file do not add up to its size")
    for path in sizes:  # "a" and "a/b" cannot both be files
        for parent in map(str, PurePosixPath(path).parents):
            if parent in sizes:
                raise BadArtifact(f"{where}: {parent!r} is both a file and the directory of {path!r} (refused)")
    if config.get("files") != sizes:
        raise BadArtifact(f"{where}: the layers do not hold exactly the files the step manifest lists")
    ann = manifest.get("annotations") or {}
    total = sum(p.size for p in parts)
    if (A_BYTES in ann and str(ann[A_BYTES]) != str(total)) or (A_FILES in ann and str(ann[A_FILES]) != str(len(sizes))):
        raise BadArtifact(f"{where}: its annotations say {ann.get(A_BYTES)} bytes in {ann.get(A_FILES)} files, its "
                          f"layers hold {total} bytes in {len(sizes)} (refused)")
    return parts


def _inside(dest: Path, rel: str) -> Path:
    """``dest / rel``, checked once more to resolve below ``dest`` (entries were checked by :func:`_parts`)."""
    target = dest / rel
    if not target.resolve().is_relative_to(dest.resolve()) or target.resolve() == dest.resolve():
        raise BadArtifact(f"layer file name {rel!r} resolves outside {dest} (refused)")
    return target


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
                target = _inside(dest, part.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                # A new regular file only (never through a link, never one written before), then its mode: the
                # entry's, never writable by group or others (a world-writable model.py is code anyone here could
                # change before tritonserver runs it), always readable and writable by its owner.
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                fh, current = os.fdopen(fd, "wb"), part.path
                os.chmod(target, (part.mode & PULLED_MODE_MASK) | 0o600)
            if part.size == 0:
                continue
            reg.fetch_blob(part.digest, part.size, fh, meter.advance)
            report.bytes_moved += part.size
    finally:
        if fh is not None:
            fh.close()
    report.seconds = time.monotonic() - t0
    return report
