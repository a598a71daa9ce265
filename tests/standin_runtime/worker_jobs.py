"""Run one of kiln's engine-runtime workers over several job files in ONE process (tests only).

    python worker_jobs.py WORKER.py JOB.json [JOB.json ...]

The image-environment matrix (tests/test_image_env.py) runs the quantize worker once per weight format, each process
quantizing every KV-cache choice of that format: the heavy imports (torch, transformers, ModelOpt) are paid once per
format instead of once per combination. Each job runs as ``python WORKER.py --job JOB.json`` would (its
``__main__``); a failing job is reported and the next one still runs. The last line is a JSON object
``{job: "ok" | error text}``; the exit code is 1 when any job failed.
"""

import json
import os
import runpy
import sys
import traceback


def main(worker, jobs):
    sys.path.insert(0, os.path.dirname(os.path.abspath(worker)))  # the workers import their siblings
    outcome = {}
    for job in jobs:
        sys.argv = [worker, "--job", job]
        try:
            runpy.run_path(worker, run_name="__main__")
            outcome[job] = "ok"
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a worker included: report, go on
            traceback.print_exc()
            outcome[job] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(outcome), flush=True)
    return 0 if all(v == "ok" for v in outcome.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
