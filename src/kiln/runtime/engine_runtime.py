"""Run a job in the recipe's engine runtime, and say exactly how.

A :class:`Job` is a command plus the host directories it reads (mounted read-only) and writes (its temporary
output directory, and a shared scratch directory for HOME, TMPDIR, the Hugging Face cache and JIT caches). The
runtime turns it into one host command line:

* ``container`` with docker: ``docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit
  stack=67108864 --shm-size=2g --user UID:GID --volume HOST:/kiln/...:ro … IMAGE CMD`` (NVIDIA's documented
  flags for TensorRT-LLM containers); podman: the same with CDI devices (``--device nvidia.com/gpu=all``),
  ``--security-opt label=disable``, no ``--shm-size`` (podman refuses it with ``--ipc=host``) and
  ``--userns keep-id`` only when podman runs rootless (rootful podman refuses it); Apptainer/Singularity (Slurm
  clusters without docker): ``apptainer exec --nv --cleanenv --no-home --bind HOST:/kiln/...:ro … docker://IMAGE
  CMD``, with the host's ``CUDA_VISIBLE_DEVICES`` (Slurm's GPU binding) passed through ``--env`` because
  ``--cleanenv`` drops it. ``--cleanenv`` stays on: a cluster's module environment (PYTHONPATH, LD_LIBRARY_PATH…)
  would otherwise leak into the image's Python.
  Outputs belong to the caller: docker and podman run as the caller's uid:gid, Apptainer always does.
  Every generated command line is checked against the engines' documented rules (``data/container_engines.yaml``,
  with their source lines): :func:`argv_problems`.
* ``local``: the job's command with host paths, run by the named interpreter (``engine_runtime.python``) or
  ``trtllm-build`` beside it or on PATH.

Nothing here starts a container to *describe* a job (``kiln build --dry-run``) or to fingerprint it: the
image's digest comes from ``docker image inspect`` (or the reference itself when pinned ``@sha256:``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import yaml

from kiln.recipe.containers import CONTAINER_TENSORRT, CONTAINER_TRTLLM, container_for, strip_digest, tensorrt_for
from kiln.recipe.schema import Recipe
from kiln.util.errors import KilnError

ROOT = "/kiln"
WORKERS = f"{ROOT}/workers"
SCRATCH = f"{ROOT}/scratch"
#: Environment every job gets: HOME, TMPDIR and every cache a library may write go to the scratch directory
#: (the image's own home may not be writable for the caller's uid), and nothing is downloaded inside.
SCRATCH_ENV: Mapping[str, str] = {
    "HOME": f"{SCRATCH}/home",
    "TMPDIR": f"{SCRATCH}/tmp",
    "HF_HOME": f"{SCRATCH}/hf",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "XDG_CACHE_HOME": f"{SCRATCH}/cache",
    "TRITON_CACHE_DIR": f"{SCRATCH}/cache/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{SCRATCH}/cache/inductor",
    "CUDA_CACHE_PATH": f"{SCRATCH}/cache/nv",
    "PYTHONUNBUFFERED": "1",
}
SCRATCH_DIRS = ("home", "tmp", "hf", "cache/triton", "cache/inductor", "cache/nv")
#: NVIDIA's documented limits for TensorRT-LLM containers (TensorRT-LLM installation guide; tensorrtllm_backend
#: README): locked memory unlimited, 64 MiB stacks.
ULIMITS = ("memlock=-1", "stack=67108864")
CONTAINER_ENGINES = ("docker", "podman", "apptainer", "singularity")
#: Environment variables that carry a scheduler's GPU binding into a job (Slurm sets CUDA_VISIBLE_DEVICES).
GPU_BINDING_ENV = ("CUDA_VISIBLE_DEVICES",)


class RuntimeFailed(KilnError):
    """A job failed in the engine runtime (the message carries the log's tail and the command)."""


@functools.lru_cache(maxsize=None)
def engine_rules() -> dict[str, Any]:
    """The container engines' documented rules (``data/container_engines.yaml``: rules and their sources)."""
    text = (resources.files("kiln.runtime") / "data" / "container_engines.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    for rule in data["rules"]:
        if rule["source"] not in data["sources"]:
            raise ValueError(f"container_engines.yaml: rule {rule['id']}: source {rule['source']!r} is not a key of "
                             "'sources'")
    return data


def _has_flag(argv: Sequence[str], flag: str, value: Optional[str] = None) -> bool:
    """``flag`` in argv as ``flag``, ``flag=value`` or ``flag value`` (with ``value`` when given)."""
    name, _, fixed = flag.partition("=")
    want = value if value is not None else (fixed or None)
    for i, arg in enumerate(argv):
        if arg == name:
            got = argv[i + 1] if i + 1 < len(argv) else None
            if want is None or got == want:
                return True
        elif arg.startswith(name + "="):
            if want is None or arg.split("=", 1)[1] == want:
                return True
    return False


def argv_problems(engine: str, argv: Sequence[str], *, rootless: bool,
                  host_env: Mapping[str, str]) -> list[str]:
    """Every documented rule of ``engine`` the command line breaks, each with the engine's refusal, the fix and the
    source (``data/container_engines.yaml``)."""
    engine = "apptainer" if engine == "singularity" else engine
    data = engine_rules()
    problems = []
    for rule in data["rules"]:
        if rule["engine"] != engine:
            continue
        kind = rule["kind"]
        broken = False
        if kind == "exclusive":
            broken = all(_has_flag(argv, f) for f in rule["flags"])
        elif kind == "rootless_only":
            broken = not rootless and _has_flag(argv, rule["flag"], rule.get("value"))
        elif kind == "cleanenv_drops":
            if _has_flag(argv, rule["flag"]):
                passed = {a.split("=", 1)[0] for i, a in enumerate(argv) if i and argv[i - 1] == "--env"}
                broken = any(name in host_env and name not in passed for name in rule["env"])
        else:
            raise ValueError(f"container_engines.yaml: rule {rule['id']}: unknown kind {kind!r}")
        if broken:
            src = data["sources"][rule["source"]]
            problems.append(f"{engine}: {rule['refusal']}; {rule['fix']} [{rule['id']}: {src['repo']} "
                            f"{src['path']} @ {src['commit']}]")
    return problems


def podman_rootless(exe: str) -> bool:
    """Whether podman runs rootless: ``podman info --format {{.Host.Security.Rootless}}`` (it starts no
    container); when podman cannot answer, whether this process is not root (podman run by root is rootful)."""
    try:
        proc = subprocess.run([exe, "info", "--format", "{{.Host.Security.Rootless}}"], capture_output=True,
                              text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        proc = None
    answer = proc.stdout.strip().lower() if proc is not None and proc.returncode == 0 else ""
    if answer in ("true", "false"):
        return answer == "true"
    return os.geteuid() != 0


@dataclass(frozen=True)
class Mount:
    """A host directory the job sees at ``target`` (inside a container; a local job uses the host path)."""

    host: Path
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class Job:
    """One command in the engine runtime: ``argv`` is built from the paths the runtime gives each mount."""

    name: str
    mounts: Mapping[str, Mount]
    argv: Callable[[Mapping[str, str]], list[str]]
    workdir: str = "out"
    """The mount the command starts in."""
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RuntimeVersions:
    """What the runtime reports about itself (the probe worker's output)."""

    tensorrt_llm: Optional[str]
    tensorrt: Optional[str]
    modelopt: Optional[str]
    transformers: Optional[str]
    torch: Optional[str]
    gpus: tuple[str, ...] = ()
    python: Optional[str] = None

    @classmethod
    def from_probe(cls, data: Mapping) -> "RuntimeVersions":
        pkgs = data.get("packages", {})
        return cls(tensorrt_llm=pkgs.get("tensorrt_llm"), tensorrt=pkgs.get("tensorrt"),
                   modelopt=pkgs.get("nvidia-modelopt"), transformers=pkgs.get("transformers"),
                   torch=pkgs.get("torch"), gpus=tuple(g.get("name", "?") for g in data.get("gpus", [])),
                   python=data.get("python"))

    def as_dict(self) -> dict:
        return {"tensorrt_llm": self.tensorrt_llm, "tensorrt": self.tensorrt, "nvidia-modelopt": self.modelopt,
                "transformers": self.transformers, "torch": self.torch, "gpus": list(self.gpus),
                "python": self.python}


def workers_dir() -> Path:
    """kiln's standalone worker scripts (mounted read-only into the runtime)."""
    return Path(str(resources.files("kiln.runtime") / "workers"))


def runtime_image(recipe: Recipe) -> str:
    """The container image the recipe's engine runtime uses: ``engine_runtime.image``, else the container table's
    newest image shipping ``engine_runtime.trtllm_version``."""
    rt = recipe.engine_runtime
    return rt.image or container_for(rt.trtllm_version)


def expected_versions(recipe: Recipe) -> tuple[str, Optional[str]]:
    """(TensorRT-LLM, TensorRT) versions the runtime must report: the table's row for the image when it is in the
    table, else ``trtllm_version`` and the TensorRT the table pairs with it (None: unknown, not checked)."""
    rt = recipe.engine_runtime
    if rt.kind == "container":
        tag = strip_digest(runtime_image(recipe))
        if tag in CONTAINER_TRTLLM:
            return CONTAINER_TRTLLM[tag], CONTAINER_TENSORRT[tag]
    return rt.trtllm_version, tensorrt_for(rt.trtllm_version)


def check_versions(recipe: Recipe, got: RuntimeVersions) -> list[str]:
    """Differences between what the runtime reports and what the container table says it must be."""
    want_trtllm, want_trt = expected_versions(recipe)
    problems = []
    if got.tensorrt_llm != want_trtllm:
        problems.append(f"TensorRT-LLM is {got.tensorrt_llm or 'absent'} in the runtime, the recipe and kiln's "
                        f"container table say {want_trtllm}")
    if want_trt is not None and got.tensorrt != want_trt:
        problems.append(f"TensorRT is {got.tensorrt or 'absent'} in the runtime, kiln's container table says "
                        f"{want_trt} for TensorRT-LLM {want_trtllm}")
    return problems


class EngineRuntime:
    """Turns jobs into host command lines and runs them, with a log and a progress line."""

    kind = "?"

    def paths(self, job: Job) -> dict[str, str]:
        """Where each of the job's mounts is, as the job's command sees it."""
        raise NotImplementedError

    def command(self, job: Job) -> list[str]:
        """The exact host command line for the job."""
        raise NotImplementedError

    def identity(self) -> dict[str, str]:
        """What the runtime is, for fingerprints and records (cheap: starts nothing)."""
        raise NotImplementedError

    def problems(self) -> list[str]:
        """Why jobs cannot run here (missing engine or daemon, image not present…), each with the fix."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def worker(self, job_paths: Mapping[str, str], name: str) -> str:
        return f"{job_paths['workers']}/{name}"

    def python(self) -> str:
        return "python3"

    # ------------------------------------------------------------------------------------------- running

    def run(self, job: Job, log: Path, status: Optional[Callable[[str], None]] = None) -> str:
        """Run the job, its output to ``log``; returns the output. RuntimeFailed (with the log's tail) on failure."""
        for mount in job.mounts.values():
            if not mount.read_only:
                mount.host.mkdir(parents=True, exist_ok=True)
        cmd = self.command(job)
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(log, "w", encoding="utf-8") as fh:
            fh.write("$ " + shlex.join(cmd) + "\n")
            fh.flush()
            try:
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=self._host_env())
            except OSError as exc:
                raise RuntimeFailed(f"cannot start {cmd[0]}: {exc}") from None
            while proc.poll() is None:
                if status is not None:
                    status(f"{job.name} in {self.describe()} ({time.monotonic() - started:.0f}s) "
                           f"{_last_line(log)[:80]}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)  # the same status cadence, but back as soon as the job exits
        text = log.read_text(encoding="utf-8", errors="replace")
        if proc.returncode != 0:
            tail = "".join(text.splitlines(keepends=True)[-20:])
            kept = self._keep_log(log, job)
            raise RuntimeFailed(f"{job.name} failed in {self.describe()} (exit {proc.returncode}); last lines of "
                                f"{kept}:\n{tail}")
        return text

    def _keep_log(self, log: Path, job: Job) -> Path:
        """A failed job's log, copied out of the step's temporary output (removed when the step fails) to
        ``<scratch>/logs/`` (the build folder's ``.engine-runtime``), so the path in the message stays readable."""
        scratch = getattr(self, "scratch", None)
        if scratch is None:
            return log
        kept = Path(scratch) / "logs" / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, kept)
        except OSError:
            return log
        return kept.resolve()

    def _host_env(self) -> dict[str, str]:
        return dict(os.environ)


def gpu_flags(engine: str, gpus: str = "all") -> list[str]:
    """How docker or podman hands a container the GPUs (``all`` or a comma-separated list of indices): docker's
    NVIDIA Container Toolkit ``--gpus``, podman's CDI devices (with SELinux labels off, as NVIDIA's CDI guide says)."""
    if engine == "podman":
        devices = ["all"] if gpus == "all" else gpus.split(",")
        return [a for dev in devices for a in ("--device", f"nvidia.com/gpu={dev}")] + ["--security-opt",
                                                                                       "label=disable"]
    return ["--gpus", "all" if gpus == "all" else f'"device={gpus}"']


def ulimit_flags() -> list[str]:
    """NVIDIA's documented ulimits for TensorRT-LLM containers (:data:`ULIMITS`)."""
    return [a for limit in ULIMITS for a in ("--ulimit", limit)]


def _container_name(job: Job, mounts: Mapping[str, Mount]) -> str:
    """A name that says what runs and is unique per output directory (one writer per output, under its lock)."""
    import hashlib

    out = mounts.get(job.workdir)
    key = str(out.host.resolve()) if out is not None else job.name
    return f"kiln-{job.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if len(lines) > 1 else ""


@dataclass
class ContainerRuntime(EngineRuntime):
    """docker / podman / apptainer (singularity) running ``image``."""

    engine: str
    exe: str
    image: str
    gpus: str = "all"
    shm_size: str = "2g"
    scratch: Path = Path("build/.engine-runtime")
    user: tuple[int, int] = field(default_factory=lambda: (os.getuid(), os.getgid()))
    kind: str = "container"
    rootless: Optional[bool] = None
    """podman only: whether it runs rootless (None: ask ``podman info`` when a command is built)."""
    host_env: Optional[Mapping[str, str]] = None
    """The environment the engine is started from (None: this process's); Apptainer passes its GPU binding on."""

    def _rootless(self) -> bool:
        if self.rootless is None:
            self.rootless = podman_rootless(self.exe)
        return self.rootless

    def _host(self) -> Mapping[str, str]:
        return os.environ if self.host_env is None else self.host_env

    def paths(self, job: Job) -> dict[str, str]:
        return {name: m.target for name, m in self._mounts(job).items()}

    def _mounts(self, job: Job) -> dict[str, Mount]:
        return {"workers": Mount(workers_dir(), WORKERS, True), **job.mounts,
                "scratch": Mount(self.scratch.resolve(), SCRATCH, False)}

    def _image_uri(self) -> str:
        if self.engine in ("apptainer", "singularity"):
            return self.image if self.image.endswith(".sif") or "://" in self.image else f"docker://{self.image}"
        return self.image

    def command(self, job: Job) -> list[str]:
        argv = self._command(job)
        problems = argv_problems(self.engine, argv, rootless=self.engine != "podman" or self._rootless(),
                                 host_env=self._host())
        if problems:
            raise KilnError("kiln generated a command line the container engine refuses (a bug in kiln):\n  - " +
                            "\n  - ".join(problems) + "\n$ " + shlex.join(argv))
        return argv

    def _command(self, job: Job) -> list[str]:
        mounts = self._mounts(job)
        paths = {name: m.target for name, m in mounts.items()}
        env = {**SCRATCH_ENV, **job.env}
        workdir = paths[job.workdir]
        if self.engine in ("apptainer", "singularity"):
            argv = [self.exe, "exec", "--nv", "--cleanenv", "--no-home"]
            for m in mounts.values():
                argv += ["--bind", f"{m.host.resolve()}:{m.target}:{'ro' if m.read_only else 'rw'}"]
            if self.gpus != "all":
                env = {**env, "CUDA_VISIBLE_DEVICES": self.gpus}
            else:  # --cleanenv drops the scheduler's GPU binding: pass it on
                env = {**env, **{k: self._host()[k] for k in GPU_BINDING_ENV if k in self._host()}}
            for key, value in env.items():
                argv += ["--env", f"{key}={value}"]
            return [*argv, "--pwd", workdir, self._image_uri(), *job.argv(paths)]
        argv = [self.exe, "run", "--rm", "--name", _container_name(job, mounts), *gpu_flags(self.engine, self.gpus)]
        if self.engine == "podman" and self._rootless():  # rootful podman refuses keep-id; it maps uids 1:1
            argv += ["--userns", "keep-id"]
        argv += ["--ipc=host", *ulimit_flags()]
        if self.engine != "podman":  # podman refuses --shm-size with --ipc=host (the host's /dev/shm is shared)
            argv += [f"--shm-size={self.shm_size}"]
        argv += ["--user", f"{self.user[0]}:{self.user[1]}"]
        for m in mounts.values():
            argv += ["--volume", f"{m.host.resolve()}:{m.target}:{'ro' if m.read_only else 'rw'}"]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        return [*argv, "--workdir", workdir, self.image, *job.argv(paths)]

    def run(self, job: Job, log: Path, status: Optional[Callable[[str], None]] = None) -> str:
        for sub in SCRATCH_DIRS:
            (self.scratch / sub).mkdir(parents=True, exist_ok=True)
        return super().run(job, log, status)

    def digest(self) -> Optional[str]:
        """The image's content digest, without starting a container: from a pinned reference, else from the
        engine's local image store (docker/podman ``image inspect``); None when the engine cannot tell."""
        if "@sha256:" in self.image:
            return "sha256:" + self.image.split("@sha256:", 1)[1]
        if self.engine in ("apptainer", "singularity"):
            return None
        try:
            proc = subprocess.run([self.exe, "image", "inspect", "--format", "{{json .RepoDigests}}", self.image],
                                  capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        if proc.returncode != 0:
            return None
        try:
            digests = json.loads(proc.stdout.strip() or "[]")
        except ValueError:
            return None
        repo = strip_digest(self.image).rsplit(":", 1)[0]
        for d in digests or []:
            if isinstance(d, str) and "@sha256:" in d and d.split("@", 1)[0] == repo:
                return "sha256:" + d.split("@sha256:", 1)[1]
        return None

    def pinned_image(self) -> str:
        """The image reference pinned by digest when the digest is known (what deploy files should name)."""
        digest = self.digest()
        if digest is None or "@sha256:" in self.image:
            return self.image
        return f"{strip_digest(self.image)}@{digest}"

    def identity(self) -> dict[str, str]:
        return {"kind": "container", "image": self.image, "digest": self.digest() or "unknown"}

    def describe(self) -> str:
        return f"{self.engine} {self.image}"

    def problems(self) -> list[str]:
        problems: list[str] = []
        if self.engine in ("apptainer", "singularity"):
            return problems  # no daemon; the image is fetched (docker://) or read (.sif) at run time
        try:
            info = subprocess.run([self.exe, "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                                  text=True, timeout=20, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            return [f"{self.engine} does not answer ({exc}): start it, or set engine_runtime.container_engine"]
        if info.returncode != 0:
            first = (info.stderr or info.stdout).strip().splitlines()[:1]
            return [f"the {self.engine} daemon is not reachable ({first[0] if first else 'no answer'}): start it "
                    f"(e.g. `sudo systemctl start {self.engine}`), or set engine_runtime.container_engine"]
        inspect = subprocess.run([self.exe, "image", "inspect", self.image], capture_output=True, text=True,
                                 timeout=30, check=False)
        if inspect.returncode != 0:
            problems.append(f"the image {self.image} is not present locally: pull it first with "
                            f"`{self.engine} pull {self.image}` (about 14 GB)")
        return problems


@dataclass
class LocalRuntime(EngineRuntime):
    """A local interpreter that has tensorrt_llm (``engine_runtime.python``), ``trtllm-build`` beside it or on
    PATH. Jobs see host paths."""

    interpreter: str = "python3"
    scratch: Path = Path("build/.engine-runtime")
    kind: str = "local"

    def paths(self, job: Job) -> dict[str, str]:
        return {name: str(m.host.resolve()) for name, m in
                {"workers": Mount(workers_dir(), WORKERS), **job.mounts}.items()}

    def python(self) -> str:
        return self.interpreter

    def command(self, job: Job) -> list[str]:
        paths = self.paths(job)
        argv = job.argv(paths)
        if argv and argv[0] == "trtllm-build":
            argv = [self.trtllm_build(), *argv[1:]]
        return argv

    def trtllm_build(self) -> str:
        beside = Path(self.interpreter).parent / "trtllm-build"
        if os.sep in self.interpreter and beside.exists():
            return str(beside)
        return shutil.which("trtllm-build") or "trtllm-build"

    def _host_env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1"}

    def identity(self) -> dict[str, str]:
        return {"kind": "local", "python": self.interpreter}

    def describe(self) -> str:
        return f"local {self.interpreter}"

    def problems(self) -> list[str]:
        exe = shutil.which(self.interpreter) or (self.interpreter if Path(self.interpreter).exists() else None)
        if exe is None:
            return [f"the interpreter {self.interpreter} does not exist: set engine_runtime.python to a Python that "
                    "has tensorrt_llm, or use engine_runtime.kind: container"]
        return []


def _find_engine(wanted: str) -> tuple[Optional[str], Optional[str]]:
    """(engine name, executable) for ``wanted`` (`auto`: the first of docker, podman, apptainer, singularity)."""
    for name in (CONTAINER_ENGINES if wanted == "auto" else (wanted,)):
        exe = shutil.which(name)
        if exe:
            return ("apptainer" if name == "singularity" else name), exe
    return None, None


def engine_runtime_for(recipe: Recipe, build_root: Path) -> EngineRuntime:
    """The recipe's engine runtime (never starts anything). A container runtime whose engine is not installed
    still describes its jobs (for --dry-run), naming the engine it would use; its problems() say what is missing."""
    rt = recipe.engine_runtime
    scratch = build_root / ".engine-runtime"
    if rt.kind == "local":
        python = rt.python or "python3"
        if Path(python).is_dir():
            python = str(Path(python) / "bin" / "python")
        return LocalRuntime(interpreter=python, scratch=scratch)
    name, exe = _find_engine(rt.container_engine)
    if name is None:
        wanted = "docker" if rt.container_engine == "auto" else rt.container_engine
        return _MissingEngine(engine=wanted, exe=wanted, image=runtime_image(recipe), gpus=rt.gpus,
                              shm_size=rt.shm_size, scratch=scratch, wanted=rt.container_engine)
    return ContainerRuntime(engine=name, exe=exe, image=runtime_image(recipe), gpus=rt.gpus, shm_size=rt.shm_size,
                            scratch=scratch)


@dataclass
class _MissingEngine(ContainerRuntime):
    """A container runtime whose engine is not on PATH: it can describe jobs, not run them."""

    wanted: str = "auto"

    def _rootless(self) -> bool:
        if self.rootless is None:  # no podman to ask: podman run by root is rootful
            self.rootless = os.geteuid() != 0
        return self.rootless

    def digest(self) -> Optional[str]:
        return "sha256:" + self.image.split("@sha256:", 1)[1] if "@sha256:" in self.image else None

    def problems(self) -> list[str]:
        which = "docker, podman or apptainer" if self.wanted == "auto" else self.wanted
        return [f"no container engine: {which} is not on PATH. Install docker with the NVIDIA Container Toolkit "
                "(or podman with CDI, or Apptainer on a cluster), or set engine_runtime.kind: local with "
                "engine_runtime.python naming an interpreter that has tensorrt_llm"]


def probe_job() -> Job:
    """Read the runtime's versions and GPUs (the probe worker imports no tensorrt_llm)."""
    return Job("probe", {}, lambda p: ["python3", f"{p['workers']}/probe.py"], workdir="workers")


def read_versions(runtime: EngineRuntime, log: Path) -> RuntimeVersions:
    """Run the probe in the runtime and parse its report (the last line of its output)."""
    job = probe_job()
    if isinstance(runtime, LocalRuntime):
        job = Job("probe", {}, lambda p: [runtime.python(), f"{p['workers']}/probe.py"], workdir="workers")
    text = runtime.run(job, log)
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return RuntimeVersions.from_probe(json.loads(line))
            except ValueError:
                break
    raise RuntimeFailed(f"the version probe printed no report in {runtime.describe()}; see {log}")


def commands_text(cmds: Sequence[Sequence[str]]) -> list[str]:
    return ["$ " + shlex.join(c) for c in cmds]
