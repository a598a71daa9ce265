"""Where a sweep's points run, and the typed settings of each cluster executor (the sweep file's `slurm:` and
`kubernetes:` sections, overridable with `kiln sweep --set slurm.partition=gpu`).

- ``local`` (default): points run here, as today (``--jobs`` processes).
- ``slurm``: one job array per submission; each array task runs one point (:mod:`kiln.experiments.slurm`).
- ``kubernetes``: one Indexed Job per submission, one pod per point (:mod:`kiln.experiments.kubernetes`).

A job array (like an Indexed Job's pod template) gives every task the same resources, so points that need
different GPU counts (e.g. an axis over ``parallelism.tp``) go into one array (one Job) per GPU count.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.recipe.loader import LoadedRecipe

Executor = Literal["local", "slurm", "kubernetes"]
EXECUTORS: tuple[str, ...] = ("local", "slurm", "kubernetes")

# Slurm's time formats (sbatch(1) --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED|INFINITE)$")
_ONE_LINE = re.compile(r"^[^\n\r]*$")


def _one_line(values: tuple[str, ...], what: str) -> tuple[str, ...]:
    for v in values:
        if not _ONE_LINE.match(v):
            raise ValueError(f"each {what} is one line; {v!r} has a line break")
    return values


class SlurmSettings(BaseModel):
    """How points are submitted to Slurm (one `sbatch --array` per submission)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    partition: Optional[str] = None
    """`--partition` (empty: the cluster's default partition)."""
    account: Optional[str] = None
    """`--account` to charge (empty: your default account)."""
    qos: Optional[str] = None
    """`--qos` (empty: the default)."""
    time: Optional[str] = None
    """Time limit per point (`--time`: minutes, `H:M:S`, `D-H:M:S`; empty: the partition's limit)."""
    cpus_per_task: Optional[int] = Field(None, ge=1, le=1024)
    """`--cpus-per-task` per point (empty: the cluster's default)."""
    mem: Optional[str] = None
    """Memory per point (`--mem`, e.g. `64G`; empty: the cluster's default)."""
    gpu_request: Literal["gres", "gpus"] = "gres"
    """How GPUs are requested: `gres` writes `--gres=gpu[:TYPE]:N`, `gpus` writes `--gpus=[TYPE:]N`. N is the
    point's tp × pp when its target runs on a GPU (`tensorrt`), none for the CPU `reference` target."""
    gpu_type: Optional[str] = None
    """GPU type as the cluster's gres names it (e.g. `h100`), written into the request; empty: any GPU."""
    max_parallel: Optional[int] = Field(None, ge=1)
    """At most this many points at once (`--array=…%N`); empty: as many as the cluster allows."""
    sbatch: tuple[str, ...] = ()
    """Extra `#SBATCH` options, one per entry, e.g. `--constraint=h100` or `--exclusive`."""
    setup: tuple[str, ...] = ()
    """Shell lines run before each point on the compute node, e.g. `module load apptainer` or
    `source /shared/kiln/.venv/bin/activate`."""
    kiln: Optional[tuple[str, ...]] = None
    """The command that runs kiln on the compute nodes (empty: this Python, `<python> -m kiln`, which works
    where the nodes see the same filesystem, as the build cache needs anyway)."""
    poll_s: float = Field(10.0, gt=0)
    """Seconds between progress checks (`squeue`) while waiting."""

    @field_validator("time", mode="before")
    @classmethod
    def _time_text(cls, v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool):
            raise ValueError(f"write the time limit as quoted text, e.g. time: \"2:00:00\" or time: \"30\" "
                             f"(YAML reads an unquoted 2:00:00 as the number 7200; got {v})")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _SLURM_TIME.match(v):
            raise ValueError(f"{v!r} is not a Slurm time limit: write minutes, H:M:S or D-H:M:S (e.g. 2:00:00)")
        return v

    @field_validator("sbatch")
    @classmethod
    def _sbatch(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        _one_line(v, "sbatch option")
        for option in v:
            if not option.removeprefix("#SBATCH").strip().startswith("-"):
                raise ValueError(f"{option!r} is not an sbatch option: write it as on the command line, "
                                 "e.g. --constraint=h100")
        return tuple(o.removeprefix("#SBATCH").strip() for o in v)

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _one_line(v, "setup line")


class KubernetesSettings(BaseModel):
    """How points run on Kubernetes (one Indexed Job per submission, one pod per point)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    namespace: str = "default"
    """Namespace of the Job and its ConfigMap."""
    image: Optional[str] = None
    """Image the pods run: it must hold kiln and what the points need (required for this executor)."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of a GPU (NVIDIA's device plugin: `nvidia.com/gpu`); the limit is the point's
    tp × pp when its target runs on a GPU."""
    pvc: str = "kiln-build-cache"
    """PersistentVolumeClaim (ReadWriteMany, created by you) holding the shared build cache."""
    mount_path: str = "/kiln"
    """Where the PVC is mounted; the pods work there, so the cache is `<mount_path>/build`."""
    parallelism: Optional[int] = Field(None, ge=1)
    """Pods at once (empty: every point at once)."""
    retries: int = Field(0, ge=0, le=10)
    """Retries per point (`backoffLimitPerIndex`; a failed point never stops the others)."""
    cpu: Optional[str] = None
    """CPU request per pod (e.g. `8`); empty: none."""
    memory: Optional[str] = None
    """Memory request and limit per pod (e.g. `64Gi`); empty: none."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must run on, e.g. `{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}`."""
    kiln: tuple[str, ...] = ("kiln",)
    """The command that runs kiln in the image."""

    @field_validator("mount_path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") == "":
            raise ValueError(f"{v!r}: give an absolute directory other than /, e.g. /kiln")
        return v.rstrip("/")


def needs_gpu(loaded: LoadedRecipe) -> bool:
    """Whether a point's target runs on a GPU (the target's `device` in the format registry)."""
    from kiln.recipe.formats import target

    return target(loaded.recipe.target).device == "cuda"


def gpus_for(loaded: LoadedRecipe) -> int:
    """GPUs one point needs: tp × pp for a GPU target, 0 for the CPU reference target."""
    if not needs_gpu(loaded):
        return 0
    par = loaded.recipe.parallelism
    return par.tp * par.pp
