"""kiln's engine check: does this environment have the TensorRT-LLM and TensorRT that built the engine?

    python3 kiln_check_engine.py REPO

REPO is a model repository kiln packaged (its ``kiln.json`` records the versions the engine was built with).
An engine built by one TensorRT-LLM/TensorRT and served by another fails to load ("Serialization assertion
stdVersionRead == kSERIALIZATION_VERSION failed", "please rebuild"); this check refuses it at start, with the
command that rebuilds the engine for this container. Exit codes: 0 the versions agree (or nothing to check:
the reference target), 3 they differ, 2 no readable kiln.json.

kiln ships this file into every repository it packages; ``launch.sh`` and ``kiln serve`` run it. It imports
nothing but the standard library (it runs inside the serving container, where kiln is not installed).
"""

import json
import os
import sys
from importlib import metadata

NAMES = {"tensorrt_llm": ("tensorrt_llm", "tensorrt-llm"), "tensorrt": ("tensorrt", "tensorrt-cu13", "tensorrt-cu12")}
IMAGE = "nvcr.io/nvidia/tritonserver:{release}-trtllm-python-py3"


def version(names):
    """The installed version of the first of ``names`` (a package's distribution names) found, or None."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed():
    """The TensorRT-LLM and TensorRT versions of this environment (None where absent)."""
    return {key: version(names) for key, names in NAMES.items()}


def mismatches(info, found):
    """What differs between the engine's recorded versions and ``found`` (empty: nothing)."""
    if info.get("target") != "tensorrt":
        return []
    engine = info.get("engine") or {}
    return [f"{key}: the engine was built with {engine.get(key)}, this environment has {found.get(key) or 'none'}"
            for key in NAMES if engine.get(key) and engine.get(key) != found.get(key)]


def message(info, found, problems):
    """The refusal: what differs, and how to rebuild for this environment or serve where the engine runs."""
    recipe = info.get("recipe", "RECIPE")
    release = os.environ.get("NVIDIA_TRITON_SERVER_VERSION")
    here = IMAGE.format(release=release) if release else None
    rebuild = f"kiln build {recipe} --from engine --set engine_runtime.trtllm_version={found.get('tensorrt_llm')}"
    if here:
        rebuild = f"kiln build {recipe} --from engine --set engine_runtime.image={here}"
    lines = ["kiln: this engine cannot be served here: " + "; ".join(problems) + ".",
             "An engine only loads with the TensorRT-LLM and TensorRT that built it.",
             f"Rebuild it for this environment: {rebuild}"]
    if info.get("container"):
        lines.append(f"or serve it in the container that built it: {info['container']}")
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        print("usage: kiln_check_engine.py REPO", file=sys.stderr)
        return 2
    try:
        with open(os.path.join(argv[1], "kiln.json"), encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError) as exc:
        print(f"kiln: cannot read {argv[1]}/kiln.json ({exc}): is this a repository kiln packaged?", file=sys.stderr)
        return 2
    found = installed()
    problems = mismatches(info, found)
    if problems:
        print(message(info, found, problems), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
