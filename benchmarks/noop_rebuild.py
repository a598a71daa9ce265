"""No-op rebuild and serving-key change of the default recipe, against a full build.

Targets (issue: the build pipeline): a no-op rebuild ≤ 2 s wall and ≤ 2% of the full build; a serving-key
change ≤ 10% of the full build. Each figure is the wall time of a fresh `kiln build` process, as `make engine`
runs it. The built-in model is built once beforehand (cached), so the full build is resolve → package.

    .venv/bin/python benchmarks/noop_rebuild.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import build, median


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-noop-") as d:
        cwd = Path(d)
        full, summary = build(cwd)
        assert all(s["status"] == "ran" for s in summary["steps"] if s["name"] != "resolve"), summary
        noop = []
        for _ in range(args.repeats):
            seconds, summary = build(cwd)
            assert {s["status"] for s in summary["steps"]} == {"skipped"}, summary
            noop.append(seconds)
        serving = []
        for i in range(args.repeats):
            seconds, summary = build(cwd, f"serving.max_queue_delay_microseconds={100 + i}")
            ran = [s["name"] for s in summary["steps"] if s["status"] == "ran"]
            assert ran == ["package"], ran
            serving.append(seconds)
    n, s = median(noop), median(serving)
    print(f"full build (resolve→package, model cached): {full:.2f} s")
    print(f"no-op rebuild, median of {args.repeats}:       {n:.2f} s = {100 * n / full:.1f}% of full "
          f"[target ≤ 2 s and ≤ 2%: {'PASS' if n <= 2 and n / full <= 0.02 else 'FAIL'}]")
    print(f"serving-key change, median of {args.repeats}:  {s:.2f} s = {100 * s / full:.1f}% of full "
          f"[target ≤ 10%: {'PASS' if s / full <= 0.10 else 'FAIL'}]")


if __name__ == "__main__":
    main()
