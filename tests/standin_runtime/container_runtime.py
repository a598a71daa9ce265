"""STAND-IN for docker, podman and apptainer, for tests on machines with no container daemon and no GPU.

It is installed on PATH under those names (see tests/standin_runtime/__init__.py). It never presents itself as a
GPU run: it records every invocation (argv and the environment asked for) to $KILN_STANDIN_LOG as JSON lines,
answers `info` and `image inspect` from $KILN_STANDIN_DAEMON / $KILN_STANDIN_IMAGES, and runs a container's
command in a bubblewrap sandbox that reproduces what the tests assert about a container:

* the mounts exactly as given, read-only ones really read-only (`--ro-bind`), under a private /kiln;
* the working directory and the environment the command line sets, and nothing else of the caller's;
* the "image" is $KILN_STANDIN_IMAGE_ROOT: its bin/ (python3, a stand-in trtllm-build) first on PATH and its
  site/ (a stand-in tensorrt_llm package and the package metadata of the versions the test chose) on
  PYTHONPATH.

    container_runtime.py PROG ARGS...   (PROG: the name it was called by)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def log(prog: str, argv: list[str]) -> None:
    path = os.environ.get("KILN_STANDIN_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"prog": prog, "argv": argv}) + "\n")


def images() -> dict[str, str]:
    return json.loads(os.environ.get("KILN_STANDIN_IMAGES", "{}"))


def repo_of(ref: str) -> str:
    return ref.split("@", 1)[0].rsplit(":", 1)[0] if "/" in ref.split(":", 1)[0] or ":" in ref else ref


def take(args: list[str], i: int, flag: str) -> tuple[str, int]:
    """The value of ``flag`` at args[i]: ``--flag=value`` or ``--flag value``."""
    if "=" in args[i] and args[i].startswith(flag + "="):
        return args[i].split("=", 1)[1], i + 1
    return args[i + 1], i + 2


VALUE_FLAGS = {"--name", "--gpus", "--device", "--security-opt", "--userns", "--ulimit", "--shm-size", "--user",
               "--volume", "-v", "--env", "-e", "--workdir", "-w", "--ipc", "--bind", "--pwd", "-p"}


def parse(args: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Flags (in order, repeated ones kept) until the first non-flag word: the image; then the command."""
    flags: dict[str, list[str]] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name = args[i].split("=", 1)[0]
        if name in VALUE_FLAGS:
            value, i = take(args, i, name)
            flags.setdefault(name, []).append(value)
        else:
            flags.setdefault(name, []).append("")
            i += 1
    return flags, args[i:]


def sandbox(mounts: list[tuple[str, str, bool]], workdir: str, env: dict[str, str], command: list[str]) -> int:
    """Run ``command`` in bubblewrap: a private root that binds the host's top-level directories (no trace left
    on the host), a private /kiln with the mounts, and only ``env``."""
    root = os.environ["KILN_STANDIN_IMAGE_ROOT"]
    argv = ["bwrap", "--die-with-parent", "--tmpfs", "/"]
    for entry in sorted(os.listdir("/")):
        path = "/" + entry
        if entry in ("proc", "dev", "kiln"):
            continue
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--bind", path, path]
    argv += ["--proc", "/proc", "--dev-bind", "/dev", "/dev", "--tmpfs", "/kiln"]
    for host, target, read_only in mounts:
        argv += ["--ro-bind" if read_only else "--bind", host, target]
    argv += ["--chdir", workdir, "--clearenv"]
    full_env = {"PATH": f"{root}/bin:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": f"{root}/site",
                "LANG": "C.UTF-8", **env}
    for key, value in full_env.items():
        argv += ["--setenv", key, value]
    return subprocess.call(argv + ["--"] + command)


def docker_like(prog: str, args: list[str]) -> int:
    if args[:1] == ["info"]:
        if os.environ.get("KILN_STANDIN_DAEMON") == "down":
            print(f"Cannot connect to the {prog.capitalize()} daemon at unix:///var/run/{prog}.sock. Is the "
                  f"{prog} daemon running?", file=sys.stderr)
            return 1
        print("28.2.2 (stand-in)")
        return 0
    if args[:2] == ["image", "inspect"]:
        rest = args[2:]
        fmt = None
        if rest[:1] == ["--format"]:
            fmt, rest = rest[1], rest[2:]
        ref = rest[0]
        known = images()
        if ref not in known:
            print(f"Error: No such image: {ref}", file=sys.stderr)
            return 1
        digests = [f"{repo_of(ref)}@{known[ref]}"]
        print(json.dumps(digests) if fmt and "RepoDigests" in fmt else json.dumps([{"RepoDigests": digests}]))
        return 0
    if args[:1] == ["run"]:
        flags, rest = parse(args[1:])
        image, command = rest[0], rest[1:]
        if image not in images():
            print(f"Unable to find image '{image}' locally (stand-in: nothing can be pulled here)", file=sys.stderr)
            return 125
        mounts = []
        for spec in flags.get("--volume", []) + flags.get("-v", []):
            host, target, mode = spec.rsplit(":", 2)
            mounts.append((host, target, mode == "ro"))
        env = dict(e.split("=", 1) for e in flags.get("--env", []) + flags.get("-e", []))
        workdir = (flags.get("--workdir") or flags.get("-w") or ["/"])[-1]
        return sandbox(mounts, workdir, env, command)
    print(f"stand-in {prog}: unsupported command {args[:2]}", file=sys.stderr)
    return 2


def apptainer_like(prog: str, args: list[str]) -> int:
    if args[:1] != ["exec"]:
        print(f"stand-in {prog}: unsupported command {args[:1]}", file=sys.stderr)
        return 2
    flags, rest = parse(args[1:])
    image, command = rest[0], rest[1:]
    ref = image[len("docker://"):] if image.startswith("docker://") else image
    if ref not in images():
        print(f"FATAL: could not fetch {image} (stand-in: nothing can be pulled here)", file=sys.stderr)
        return 255
    mounts = []
    for spec in flags.get("--bind", []):
        host, target, mode = spec.rsplit(":", 2)
        mounts.append((host, target, mode == "ro"))
    env = dict(e.split("=", 1) for e in flags.get("--env", []))
    return sandbox(mounts, (flags.get("--pwd") or ["/"])[-1], env, command)


def main() -> int:
    prog = os.path.basename(sys.argv[1])
    args = sys.argv[2:]
    log(prog, args)
    if prog in ("apptainer", "singularity"):
        return apptainer_like(prog, args)
    return docker_like(prog, args)


if __name__ == "__main__":
    sys.exit(main())
