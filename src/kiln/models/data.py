"""Text for calibration and evaluation: read it, check it, tokenize it, hash it.

A data source (``quantization.calibration`` or ``evaluation`` in a recipe) names its text as one of:

- a local ``.txt`` file: one sample per paragraph (paragraphs are separated by blank lines);
- a local ``.jsonl`` file: one JSON object per line, the text under the key ``column``;
- a local ``.parquet`` file: the text in column ``column`` (read with pyarrow);
- ``hf:org/name[@revision]``: a hub dataset (``datasets.load_dataset`` with ``subset`` and ``split``);
- ``builtin:tiny-llama-calib`` / ``builtin:tiny-llama-heldout``: the built-in model's corpus splits.

Every problem with the data — a missing or unreadable file, an unknown extension, a missing, empty or
non-text column, fewer usable samples than asked — is an :class:`~kiln.util.errors.InputError` raised
before any model is loaded, naming the file and the recipe key to change.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from kiln.recipe.schema import BUILTIN_PREFIX, HF_PREFIX
from kiln.util.errors import InputError

if TYPE_CHECKING:
    import torch

#: Local file types kiln reads, by extension.
LOCAL_FORMATS = (".txt", ".jsonl", ".parquet")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")


class DataSourceLike(Protocol):
    """The fields of a recipe data source (:class:`kiln.recipe.schema.DataSource`) this module reads."""

    dataset: str
    subset: Optional[str]
    split: str
    column: str


# --------------------------------------------------------------------------------------------- loading


def load_texts(source: DataSourceLike, key: str = "quantization.calibration") -> list[str]:
    """All texts of a data source, in order (empty and whitespace-only entries dropped).

    ``key`` is the recipe section the source came from (``quantization.calibration`` or ``evaluation``),
    used in error messages. Raises InputError for anything wrong with the data.
    """
    dataset = source.dataset
    if dataset.startswith(BUILTIN_PREFIX):
        texts = _builtin_texts(dataset, key)
        where = dataset
    elif dataset.startswith(HF_PREFIX):
        texts = _hub_texts(source, key)
        where = dataset
    else:
        path = _local_path(dataset, key)
        suffix = path.suffix.lower()
        if suffix == ".txt":
            texts = _txt_texts(path, key)
        elif suffix == ".jsonl":
            texts = _jsonl_texts(path, source.column, key)
        else:
            texts = _parquet_texts(path, source.column, key)
        where = str(path)
    texts = [t for t in texts if t.strip()]
    if not texts:
        plain = dataset.endswith(".txt") or dataset.startswith(BUILTIN_PREFIX)
        column = "" if plain else f" (column {source.column!r})"
        raise InputError(f"{key}.dataset: {where}{column} holds no text: every entry is empty")
    return texts


def _builtin_texts(dataset: str, key: str) -> list[str]:
    from kiln.models import tiny

    name = dataset[len(BUILTIN_PREFIX):]
    if name == "tiny-llama-calib":
        return list(tiny.calibration_texts())
    if name == "tiny-llama-heldout":
        return list(tiny.heldout_texts())
    raise InputError(f"{key}.dataset: unknown built-in dataset {dataset!r}; "
                     "known: builtin:tiny-llama-calib, builtin:tiny-llama-heldout")


def _local_path(dataset: str, key: str) -> Path:
    path = Path(dataset).expanduser()
    suffix = path.suffix.lower()
    if suffix not in LOCAL_FORMATS:
        raise InputError(f"{key}.dataset: {dataset!r} has an unsupported extension {suffix or '(none)'!r}; "
                         "use a .txt (paragraphs), .jsonl or .parquet file, hf:org/name or a builtin: dataset")
    if not path.exists():
        raise InputError(f"{key}.dataset: file {dataset!r} not found (looked for {path.absolute()})")
    if not path.is_file():
        raise InputError(f"{key}.dataset: {dataset!r} is not a file")
    return path


def _read_text(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{key}.dataset: {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise InputError(f"{key}.dataset: cannot read {path}: {exc.strerror or exc}") from None


def _txt_texts(path: Path, key: str) -> list[str]:
    """One sample per paragraph: the file split on blank lines."""
    return [p.strip() for p in _PARAGRAPH_BREAK.split(_read_text(path, key)) if p.strip()]


def _jsonl_texts(path: Path, column: str, key: str) -> list[str]:
    texts: list[str] = []
    keys_seen: set[str] = set()
    for lineno, line in enumerate(_read_text(path, key).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{key}.dataset: {path}:{lineno} is not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{key}.dataset: {path}:{lineno} is a JSON {type(row).__name__}, not an object; "
                             "each line must be an object such as {\"text\": \"...\"}")
        keys_seen.update(row)
        if column not in row:
            if not texts and lineno == 1:
                raise InputError(f"{key}.column: {path} has no key {column!r} (line 1 has: "
                                 f"{', '.join(sorted(row)) or 'no keys'}); set {key}.column")
            raise InputError(f"{key}.column: {path}:{lineno} has no key {column!r}")
        value = row[column]
        if value is None:
            continue
        if not isinstance(value, str):
            raise InputError(f"{key}.column: {column!r} in {path}:{lineno} holds {type(value).__name__} values, "
                             f"not text; set {key}.column to a text key (keys: {', '.join(sorted(keys_seen))})")
        texts.append(value)
    return texts


def _parquet_texts(path: Path, column: str, key: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(str(path))
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{key}.dataset: {path} is not a readable Parquet file ({exc})") from None
    if column not in schema.names:
        raise InputError(f"{key}.column: {path} has no column {column!r} (columns: {', '.join(schema.names)}); "
                         f"set {key}.column")
    field_type = schema.field(column).type
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)
            or getattr(pa.types, "is_string_view", lambda _t: False)(field_type)):
        raise InputError(f"{key}.column: column {column!r} in {path} holds {field_type} values, not text; "
                         f"set {key}.column to a text column")
    try:
        table = pq.read_table(str(path), columns=[column])
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{key}.dataset: cannot read {path} ({exc})") from None
    return [v for v in table.column(column).to_pylist() if v is not None]


def _hub_texts(source: DataSourceLike, key: str) -> list[str]:
    """A hub dataset's text column (``datasets.load_dataset``); any failure is an InputError."""
    from datasets import Value, load_dataset

    repo_id, _, revision = source.dataset[len(HF_PREFIX):].partition("@")
    try:
        ds = load_dataset(repo_id, source.subset, split=source.split, revision=revision or None)
    except Exception as exc:  # noqa: BLE001 - network, auth, bad subset/split: all the user's to fix
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise InputError(f"{key}.dataset: cannot load {repo_id}"
                         + (f" ({source.subset})" if source.subset else "") + f" split {source.split!r}: {reason}. "
                         f"Check {key}.dataset, {key}.subset and {key}.split and your network, or save the text "
                         "as a local .jsonl/.parquet file") from None
    if source.column not in ds.column_names:
        raise InputError(f"{key}.column: {repo_id} has no column {source.column!r} "
                         f"(columns: {', '.join(ds.column_names)}); set {key}.column")
    feature = ds.features[source.column]
    if not (isinstance(feature, Value) and feature.dtype in ("string", "large_string")):
        raise InputError(f"{key}.column: column {source.column!r} of {repo_id} holds {feature}, not text; "
                         f"set {key}.column to a text column")
    return [v for v in ds[source.column] if v is not None]


# --------------------------------------------------------------------------------------------- tokenize


def _choose(texts: list[str], tokenizer: Any, samples: int, max_seq_len: int, seed: Optional[int], key: str,
            min_tokens: int) -> dict[int, list[int]]:
    order = list(range(len(texts)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    usable: dict[int, list[int]] = {}
    for index in order:  # tokenize only as many texts as it takes (a large dataset is not read whole)
        ids = tokenizer(texts[index], add_special_tokens=True, truncation=True, max_length=max_seq_len)["input_ids"]
        if len(ids) >= min_tokens:
            usable[index] = list(ids)
            if len(usable) == samples:
                break
    if len(usable) < samples:
        raise InputError(f"{key}.samples: asked for {samples} samples but the data has only {len(usable)} usable "
                         f"(texts of at least {min_tokens} tokens, out of {len(texts)} texts); lower {key}.samples "
                         f"to {len(usable)} or less, or give more text")
    return usable


def tokenize_samples(texts: list[str], tokenizer: Any, samples: int, max_seq_len: int, seed: Optional[int],
                     key: str = "quantization.calibration", min_tokens: int = 2) -> list[torch.Tensor]:
    """``samples`` token sequences (1-D int64 tensors, at most ``max_seq_len`` tokens each).

    Texts are tokenized with the tokenizer's special tokens (e.g. BOS) and truncated; those shorter than
    ``min_tokens`` are not usable. When there are more usable texts than asked, a seeded random choice is
    taken, kept in the original order (with ``seed=None``: the first ``samples``); only as many texts as
    that takes are tokenized. Fewer usable texts than asked is an InputError saying how many were found
    and which key to lower (``{key}.samples``).
    """
    import torch

    usable = _choose(texts, tokenizer, samples, max_seq_len, seed, key, min_tokens)
    return [torch.tensor(usable[i], dtype=torch.long) for i in sorted(usable)]


def select_texts(texts: list[str], tokenizer: Any, samples: int, max_seq_len: int, seed: Optional[int],
                 key: str = "quantization.calibration", min_tokens: int = 2) -> list[str]:
    """The texts :func:`tokenize_samples` would choose, in the same order: what a runtime that tokenizes for
    itself (TensorRT-LLM's quantizer) is given, so both paths calibrate on the same hashed data."""
    usable = _choose(texts, tokenizer, samples, max_seq_len, seed, key, min_tokens)
    return [texts[i] for i in sorted(usable)]


def batches(samples: list[torch.Tensor], batch_size: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Group samples into right-padded batches: ``{"input_ids", "attention_mask"}`` each [b, longest]."""
    import torch

    out = []
    for start in range(0, len(samples), batch_size):
        group = samples[start:start + batch_size]
        longest = max(len(s) for s in group)
        ids = torch.full((len(group), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for row, sample in enumerate(group):
            ids[row, :len(sample)] = sample
            mask[row, :len(sample)] = 1
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


# --------------------------------------------------------------------------------------------- hashing


def content_hash(source: DataSourceLike, key: str = "quantization.calibration") -> str:
    """A hash of what a data source holds, for the step fingerprint and the manifest.

    Local files: sha256 of the file bytes. Hub datasets: of the id, subset, split, column and revision.
    Built-in datasets: of the texts themselves.
    """
    dataset = source.dataset
    digest = hashlib.sha256()
    if dataset.startswith(BUILTIN_PREFIX):
        for text in _builtin_texts(dataset, key):
            digest.update(text.encode("utf-8") + b"\0")
    elif dataset.startswith(HF_PREFIX):
        repo_id, _, revision = dataset[len(HF_PREFIX):].partition("@")
        ident = {"id": repo_id, "subset": source.subset, "split": source.split, "column": source.column,
                 "revision": revision or None}
        digest.update(json.dumps(ident, sort_keys=True).encode())
    else:
        path = _local_path(dataset, key)
        try:
            with path.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
        except OSError as exc:
            raise InputError(f"{key}.dataset: cannot read {path}: {exc.strerror or exc}") from None
    return "sha256:" + digest.hexdigest()
