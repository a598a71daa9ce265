"""The text the built-in tiny model is made from: Python standard-library sources, which ship with Python.

No download is needed: the documents are cut from a fixed list of pure-Python standard-library modules
(code, comments and docstrings) found under ``sysconfig.get_paths()["stdlib"]``. The list names modules
that exist, as plain Python, in every CPython from 3.10 on, so the corpus is available everywhere; the
exact text still differs between Python releases, which is why :func:`corpus_digest` exists (the tiny
model's cache key includes it).

Two disjoint splits, by whole module so that no text leaks between them:

- the *calibration* split (:func:`calibration_texts`): what the tokenizer and the model are trained on,
  and the default ModelOpt calibration set;
- the *held-out* split (:func:`heldout_texts`): never seen in training; the default evaluation text.

Each split is a list of documents (a few hundred tokens each) in a fixed, shuffled order, so that any
prefix of it (say the first 32 documents, AWQ's calibration cap) samples many modules.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import random
import sysconfig

from kiln.util.errors import KilnError

#: Modules the tokenizer and model learn from (the calibration split). Sorted; see the module docstring.
TRAIN_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "base64", "calendar", "cmd", "code", "codecs", "contextlib", "copy",
    "csv", "dataclasses", "difflib", "dis", "enum", "filecmp", "fileinput", "fractions", "ftplib",
    "functools", "gettext", "gzip", "hmac", "inspect", "ipaddress", "linecache", "locale", "mimetypes",
    "numbers", "operator", "optparse", "os", "pickle", "pkgutil", "platform", "plistlib", "pprint",
    "quopri", "random", "reprlib", "secrets", "selectors", "shelve", "shutil", "smtplib",
    "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "typing", "uuid", "warnings", "wave", "weakref",
    "zipfile",
)

#: Modules kept out of training: the held-out (default evaluation) split. Disjoint from TRAIN_MODULES.
HELDOUT_MODULES: tuple[str, ...] = (
    "bisect", "colorsys", "fnmatch", "getopt", "glob", "heapq", "queue", "sched", "shlex", "textwrap",
)

#: A document is closed at the first blank line after it reaches this many characters ...
DOC_TARGET_CHARS = 1200
#: ... or, failing a blank line, at the first line end after this many characters.
DOC_MAX_CHARS = 2400
#: Documents shorter than this (a module's tail) are appended to the previous document.
DOC_MIN_CHARS = 200
#: Seed of the fixed document order.
ORDER_SEED = 1234
#: The share of listed modules that must be found, or the corpus is refused as too different.
MIN_FOUND_SHARE = 0.9


def stdlib_dir() -> pathlib.Path:
    """The directory holding the running Python's standard-library sources."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _module_file(root: pathlib.Path, name: str) -> pathlib.Path | None:
    """The source file of a top-level module, whether a plain module or (as zipfile since 3.12) a package."""
    for candidate in (root / f"{name}.py", root / name / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _module_sources(modules: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(name, source text) of each listed module found in the standard library, in the listed order."""
    root = stdlib_dir()
    found: list[tuple[str, str]] = []
    for name in modules:
        path = _module_file(root, name)
        if path is not None:
            # newline="" keeps the bytes' line endings, so the text is exactly what is on disk.
            with open(path, encoding="utf-8", newline="") as handle:
                found.append((name, handle.read()))
    if len(found) < MIN_FOUND_SHARE * len(modules):
        missing = sorted(set(modules) - {name for name, _ in found})
        raise KilnError(
            f"the built-in tiny model is made from Python standard-library sources, but only {len(found)} of "
            f"{len(modules)} expected modules were found under {root} (missing: {', '.join(missing[:10])}"
            f"{' …' if len(missing) > 10 else ''}). Use a Python installation that ships its .py sources "
            "(some slim images keep only .pyc files), or give the recipe a local model and dataset instead."
        )
    return tuple(found)


def split_documents(text: str) -> list[str]:
    """Cut one source file into documents at paragraph (blank-line) boundaries, a few hundred tokens each."""
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if (size >= DOC_TARGET_CHARS and not line.strip()) or size >= DOC_MAX_CHARS:
            docs.append("".join(current))
            current, size = [], 0
    if current:
        docs.append("".join(current))
    cleaned = [doc.strip("\n").rstrip() for doc in docs]
    merged: list[str] = []
    for doc in cleaned:
        if not doc.strip():
            continue
        if merged and len(doc) < DOC_MIN_CHARS:
            merged[-1] = merged[-1] + "\n\n" + doc
        else:
            merged.append(doc)
    return merged


@functools.lru_cache(maxsize=None)
def _documents(modules: tuple[str, ...]) -> tuple[str, ...]:
    """All documents of the listed modules, in a fixed shuffled order."""
    docs = [doc for _, text in _module_sources(modules) for doc in split_documents(text)]
    random.Random(ORDER_SEED).shuffle(docs)
    return tuple(docs)


def calibration_texts() -> list[str]:
    """Documents of the training split (the default calibration set), in a fixed order."""
    return list(_documents(TRAIN_MODULES))


def heldout_texts() -> list[str]:
    """Documents of the held-out split (the default evaluation text), in a fixed order."""
    return list(_documents(HELDOUT_MODULES))


def corpus_files() -> dict[str, list[str]]:
    """The module names each split was actually made from (a listed module absent here is left out)."""
    return {
        "calibration": [name for name, _ in _module_sources(TRAIN_MODULES)],
        "heldout": [name for name, _ in _module_sources(HELDOUT_MODULES)],
    }


def corpus_digest() -> str:
    """sha256 over both splits' documents: changes whenever the text the model is made from changes."""
    digest = hashlib.sha256()
    for split in (_documents(TRAIN_MODULES), _documents(HELDOUT_MODULES)):
        digest.update(str(len(split)).encode())
        for doc in split:
            encoded = doc.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    return digest.hexdigest()
