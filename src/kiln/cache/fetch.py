"""``python -m kiln.cache.fetch``: pull one cache entry, by manifest digest, into a folder — the deploy files' init
step (Kubernetes init container, Compose one-shot service) that puts the packaged Triton repository into the pod's
volume before the server starts.

It reads the entry by digest (the registry's bytes must hash to it), checks that it is the entry the deploy files
name (``--tag``: step and fingerprint), streams every layer into a temporary folder beside ``--into`` while
checking its sha256, checks the recorded facts ``--expect`` names (``FILE:KEY.PATH=VALUE``, e.g. the TensorRT-LLM
version kiln.json records against the serving image's), and only then renames the folder to ``--into``. A folder
already at ``--into`` that holds this digest (a cache volume reused across pods) is kept as it is.

Credentials come from the usual places (:mod:`kiln.cache.credentials`; in a pod, ``DOCKER_CONFIG`` pointing at the
mounted ``kubernetes.io/dockerconfigjson`` Secret). Exit status: 0 done, 1 refused (a clear message on stderr, no
traceback), 2 bad arguments. Imports nothing of kiln above :mod:`kiln.cache`, so a small image runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from kiln.cache import artifact
from kiln.cache.errors import CacheError
from kiln.cache.reference import parse_cache_url
from kiln.cache.registry import Registry
from kiln.util.dotted import dotted_get

DONE_MARK = ".kiln-entry"
"""A file in a complete fetched folder naming the manifest digest it holds."""


class Refused(Exception):
    """The entry is not the one asked for, or its recorded facts disagree with what the deployment expects."""


def _expectation(text: str) -> tuple[str, str, str]:
    target, sep, value = text.partition("=")
    file, colon, key = target.partition(":")
    if not sep or not colon or not file or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: give FILE:KEY.PATH=VALUE, e.g. kiln.json:engine.tensorrt=10.14")
    return file, key, value


def check_expectations(folder: Path, expectations: Sequence[tuple[str, str, str]], what: str) -> None:
    """Refused, naming every fact that disagrees, when a recorded value differs from the expected one."""
    problems = []
    for file, key, value in expectations:
        try:
            data = json.loads((folder / file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"{file}: unreadable ({exc})")
            continue
        recorded = dotted_get(data, key)
        if str(recorded) != value:
            problems.append(f"{file} records {key} = {recorded!r}; this deployment's image needs {value!r}")
    if problems:
        raise Refused(f"{what} does not match this deployment:\n  " + "\n  ".join(problems)
                      + "\nRebuild and package the recipe for this serving image (kiln build pushes the new entry),"
                        " then apply the deploy files it writes.")


def fetch(cache: str, tag: str, digest: str, into: Path, expectations: Sequence[tuple[str, str, str]] = (),
          registry: Optional[Registry] = None, log=print) -> str:
    """Pull entry ``digest`` (tagged ``tag``) of ``cache`` into ``into``; a line saying what happened."""
    into = Path(into)
    mark = into / DONE_MARK
    if mark.is_file() and mark.read_text().strip() == digest:
        check_expectations(into, expectations, f"{into}")
        return f"{into} already holds {digest}"
    if into.exists():
        raise Refused(f"{into} exists but holds no complete entry {digest}; remove it (a partial or other pull)")
    reg = registry or Registry(parse_cache_url(cache))
    where = f"{cache}@{digest}"
    entry = artifact.read_entry(reg, digest)
    if entry is None:
        raise Refused(f"{where}: no such manifest in the registry (was the build's push skipped or the entry "
                      "garbage-collected? Run `kiln build --cache " + cache + "` for this recipe again)")
    step, _, fingerprint = tag.partition("-")
    ann = entry.annotations
    if ann.get(artifact.A_STEP) != step or ann.get(artifact.A_FINGERPRINT) != fingerprint \
            or entry.config.get("fingerprint") != fingerprint:
        raise Refused(f"{where} is not entry {tag} (it is labelled {ann.get(artifact.A_STEP)!r} "
                      f"{str(ann.get(artifact.A_FINGERPRINT))[:16]}…)")
    into.parent.mkdir(parents=True, exist_ok=True)
    tmp = into.parent / f".{into.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        transfer = artifact.pull(reg, entry, tmp)
        check_expectations(tmp, expectations, where)
        # the step manifest (the entry's config) beside the files, as the build that made them wrote it
        (tmp / artifact.MANIFEST_NAME).write_text(json.dumps(entry.config, indent=2, sort_keys=True))
        (tmp / DONE_MARK).write_text(digest + "\n")
        os.replace(tmp, into)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return f"{into}: {transfer.describe('pulled')} from {where}, every layer verified"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.cache.fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="the remote cache: oci://HOST/REPOSITORY (oci+http:// plain)")
    parser.add_argument("--tag", required=True, help="the entry's tag: <step>-<fingerprint>")
    parser.add_argument("--digest", required=True, help="the entry's manifest digest, sha256:…")
    parser.add_argument("--into", required=True, type=Path, help="the folder to create (must not exist)")
    parser.add_argument("--expect", action="append", default=[], type=_expectation, metavar="FILE:KEY=VALUE",
                        help="a fact the pulled folder must record (repeatable)")
    args = parser.parse_args(argv)
    if not args.digest.startswith("sha256:"):
        parser.error(f"--digest {args.digest!r}: give the manifest digest, sha256:<64 hex digits>")
    try:
        print(fetch(args.cache, args.tag, args.digest, args.into, args.expect), flush=True)
    except (CacheError, Refused, OSError) as exc:
        print(f"kiln fetch: refused: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
