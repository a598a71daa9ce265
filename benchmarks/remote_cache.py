"""The remote cache, measured against a real OCI registry (Debian's docker-registry on 127.0.0.1, storage in a
temporary directory) in one run:

1. runner A (fresh build dir, cache on: builds and pushes) vs runner B (fresh build dir, same model cache: pulls
   the shared steps) on the default recipe — target: B ≤ 25% of A;
2. push and pull of a 1 GB artifact by kiln (hashing, bounded layers, sha256 checked on every pulled layer) in MB/s,
   and as a ratio to a plain HTTP upload and download of the same bytes to the same registry by curl (one
   monolithic blob PUT with the digest known in advance; one GET to a file) — target: ≥ 0.5.

    .venv/bin/python benchmarks/remote_cache.py [--recipe configs/tiny-llama.yaml] [--fast] [--gb 1] [--skip-build]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import DEFAULT_RECIPE, kiln, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from registry_harness import registry_binary, start_registry  # noqa: E402

FAST = ["--set", "quantization.format=int8_sq", "--set", "quantization.calibration.samples=8",
        "--set", "quantization.calibration.max_seq_len=64", "--set", "evaluation.samples=4",
        "--set", "evaluation.max_seq_len=64"]


def runners(url: str, recipe: Path, extra: list[str], scratch: Path) -> None:
    print(f"== runner A vs runner B: {recipe.name} {' '.join(extra)}")
    results = {}
    for name in ("A", "B"):
        cwd = scratch / f"runner-{name}"
        cwd.mkdir()
        seconds, proc = kiln("build", str(recipe), *extra, "--cache", url, "--json", "--quiet", cwd=cwd)
        if proc.returncode != 0:
            raise SystemExit(f"runner {name} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout)
        steps = ", ".join(f"{s['name']} {s['status']} {s['seconds']:.1f}s" for s in summary["steps"])
        print(f"runner {name}: {seconds:7.1f} s  ({steps})")
        results[name] = seconds
    print(f"runner B / runner A = {results['B'] / results['A']:.1%}  (target ≤ 25%)")


def _curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--fail", *args], capture_output=True, text=True, check=True)


def transfer(reg, gb: float, scratch: Path, repeats: int) -> None:
    from kiln.cache import artifact
    from kiln.cache.reference import parse_cache_url
    from kiln.cache.registry import Registry
    from kiln.util.artifacts import write_manifest

    size = int(gb * 1e9)
    src = scratch / "artifact"
    src.mkdir()
    print(f"== {size / 1e9:.1f} GB artifact (random bytes), {repeats} round(s); layers of 256 MiB")
    with open(src / "engine.bin", "wb") as fh:
        left = size
        while left:
            block = os.urandom(min(left, 64 << 20))
            fh.write(block)
            left -= len(block)
    write_manifest(src, {"step": "engine", "fingerprint": "0" * 64})
    manifest = json.loads((src / "manifest.json").read_text())
    digest = "sha256:" + hashlib.file_digest(open(src / "engine.bin", "rb"), "sha256").hexdigest()
    rows = []
    for round_ in range(repeats):
        times: dict[str, float] = {}

        def timed(name: str, fn) -> None:
            os.sync()  # no other transfer's dirty pages being written back during this one
            t0 = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - t0

        # curl: POST an upload session, PUT the whole file with its (precomputed) digest; GET it into a file.
        repo = f"baseline{round_}"

        def curl_push() -> None:
            headers = _curl("-X", "POST", "-D", "-", "-o", "/dev/null", f"http://{reg.host}/v2/{repo}/blobs/uploads/")
            loc = next(line.split(": ", 1)[1].strip() for line in headers.stdout.splitlines()
                       if line.lower().startswith("location:"))
            loc = loc if loc.startswith("http") else f"http://{reg.host}{loc}"
            _curl("-X", "PUT", "-H", "Content-Type: application/octet-stream", "--data-binary",
                  f"@{src / 'engine.bin'}", "-o", "/dev/null", f"{loc}&digest={digest}")

        def curl_pull() -> None:
            _curl("-o", str(scratch / "curl.bin"), f"http://{reg.host}/v2/{repo}/blobs/{digest}")

        # kiln: hash into 256 MiB layers, skip none (a fresh repository), push; pull with sha256 checks.
        client = Registry(parse_cache_url(reg.url(f"kiln{round_}")))
        dest = scratch / "pulled"

        def kiln_push() -> None:
            artifact.push(client, "engine-" + "0" * 64, src, manifest, 256 << 20, {})

        def kiln_pull() -> None:
            dest.mkdir()
            artifact.pull(client, artifact.read_entry(client, "engine-" + "0" * 64), dest)

        order = [("curl_push", curl_push), ("kiln_push", kiln_push), ("curl_pull", curl_pull), ("kiln_pull", kiln_pull)]
        if round_ % 2:  # alternate who goes first
            order = [order[1], order[0], order[3], order[2]]
        for name, fn in order:
            timed(name, fn)
        (scratch / "curl.bin").unlink()
        shutil.rmtree(dest)
        rows.append((times["curl_push"], times["kiln_push"], times["curl_pull"], times["kiln_pull"]))
        curl_up, kiln_up, curl_down, kiln_down = rows[-1]
        mb = size / 1e6
        print(f"round {round_ + 1}: push kiln {mb / kiln_up:6.0f} MB/s vs curl {mb / curl_up:6.0f} MB/s "
              f"(ratio {curl_up / kiln_up:.2f}); pull kiln {mb / kiln_down:6.0f} MB/s vs curl "
              f"{mb / curl_down:6.0f} MB/s (ratio {curl_down / kiln_down:.2f})")
    best = [min(r[i] for r in rows) for i in range(4)]
    mb = size / 1e6
    print(f"best of {repeats}: push kiln {mb / best[1]:.0f} MB/s, curl {mb / best[0]:.0f} MB/s → ratio "
          f"{best[0] / best[1]:.2f} "
          f"(target ≥ 0.5); pull kiln {mb / best[3]:.0f} MB/s, curl {mb / best[2]:.0f} MB/s → ratio "
          f"{best[2] / best[3]:.2f} (target ≥ 0.5)")
    print(f"median of the rounds' ratios: push {median([r[0] / r[1] for r in rows]):.2f}, "
          f"pull {median([r[2] / r[3] for r in rows]):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    ap.add_argument("--fast", action="store_true", help="int8_sq with small sample counts (the tests' settings)")
    ap.add_argument("--gb", type=float, default=1.0, help="artifact size for the transfer figures")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-build", action="store_true", help="only the transfer figures")
    ap.add_argument("--skip-transfer", action="store_true", help="only runner A vs B")
    args = ap.parse_args()
    if registry_binary() is None or shutil.which("curl") is None:
        raise SystemExit("needs docker-registry and curl (apt-get install docker-registry curl)")
    with tempfile.TemporaryDirectory(prefix="kiln-cache-bench-") as tmp:
        scratch = Path(tmp)
        reg = start_registry(scratch / "registry")
        try:
            if not args.skip_build:
                runners(reg.url(), args.recipe, FAST if args.fast else [], scratch)
            if not args.skip_transfer:
                transfer(reg, args.gb, scratch, args.repeats)
        finally:
            reg.stop()


if __name__ == "__main__":
    main()
