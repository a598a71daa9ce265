"""NVIDIA's containers that carry TensorRT-LLM and what each ships: one table that picks both the engine runtime
image (where TensorRT-LLM quantizes and builds) and the serving container (where the engine runs), because an
engine only loads in a container with the same TensorRT-LLM and TensorRT that built it; it also holds the Python
packages each image ships (the image-environment tests build a venv with exactly those).

The facts live in ``data/trtllm_containers.json``, one row per image (:class:`ContainerRow`), each naming its source
(``sources`` in the file: repository, path, commit). A malformed file fails at import, naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Final, Literal, Optional

from pydantic import BaseModel, ConfigDict, ValidationError

CONTAINERS_FILE: Final = "trtllm_containers.json"


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ContainerSource(_Data):
    repo: str
    path: str
    commit: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.repo} {self.path} @ {self.commit}"


Stack = Literal["triton-tensorrtllm", "triton-llmapi", "trtllm-serve", "dynamo"]


class ContainerRow(_Data):
    """One image and what it ships. A newer TensorRT-LLM (or another image carrying one) only adds rows; a field
    nobody has read from a source is ``None`` (or empty), never guessed."""

    image: str                                  #: the full tag, ``repository:tag``
    release: str                                #: the image's own release (``26.07``, ``1.3.0rc29``, …)
    tensorrt_llm: str
    tensorrt: Optional[str]
    modelopt: Optional[str]
    cuda: Optional[str]
    min_driver: Optional[str]                   #: the minimum host driver (``nvidia-smi``'s driver version)
    python: Optional[str]
    python_packages: dict[str, str]             #: what kiln's workers import, as the image ships it
    stacks: tuple[Stack, ...]                   #: the serving stacks the image carries
    verified: bool                              #: False: read from a default or a branch, not the release
    source: str                                 #: a key of the file's ``sources``
    note: str = ""


class ContainerRoles(_Data):
    """Which image does what when several carry the same TensorRT-LLM (repositories, in order of preference)."""

    about: str = ""
    jobs: tuple[str, ...] = ("nvcr.io/nvidia/tritonserver",)   #: where quantize/export/evaluate/build jobs run
    dynamo: tuple[str, ...] = ()                                #: what the Dynamo deploy files run


class _ContainersFile(_Data):
    about: str
    sources: dict[str, ContainerSource]
    stacks: dict[str, str]
    roles: ContainerRoles = ContainerRoles()
    rows: tuple[ContainerRow, ...]


def _load() -> _ContainersFile:
    text = (resources.files("kiln.recipe") / "data" / CONTAINERS_FILE).read_text(encoding="utf-8")
    try:
        table = _ContainersFile.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise ValueError(f"{CONTAINERS_FILE}: {problems}") from None
    for i, row in enumerate(table.rows):
        if row.source not in table.sources:
            raise ValueError(f"{CONTAINERS_FILE}: rows.{i}.source: {row.source!r} is not a key of 'sources'")
    return table


_TABLE: Final = _load()
#: Every image kiln knows, oldest first within each repository.
CONTAINER_ROWS: Final[tuple[ContainerRow, ...]] = _TABLE.rows
CONTAINER_SOURCES: Final[Mapping[str, ContainerSource]] = MappingProxyType(dict(_TABLE.sources))
#: The Triton serving images' table (``tritonserver:<yy.mm>-trtllm-python-py3``), the source most rows cite.
CONTAINERS_SOURCE: Final[ContainerSource] = _TABLE.sources["triton-compat"]
CONTAINER_REPOSITORY: Final[str] = "nvcr.io/nvidia/tritonserver"
CONTAINER_SUFFIX: Final[str] = "-trtllm-python-py3"


def _triton_rows() -> tuple[ContainerRow, ...]:
    return tuple(r for r in CONTAINER_ROWS if r.image.startswith(CONTAINER_REPOSITORY + ":"))


def _by_version() -> Mapping[str, tuple[str, ...]]:
    table: dict[str, list[str]] = {}
    for row in _triton_rows():
        table.setdefault(row.tensorrt_llm, []).append(row.image)
    return MappingProxyType({version: tuple(tags) for version, tags in table.items()})


#: TensorRT-LLM version -> Triton serving container tags that ship it, oldest first.
NGC_CONTAINERS: Final[Mapping[str, tuple[str, ...]]] = _by_version()
#: Container tag -> TensorRT version inside it (an engine must be built with the same one).
CONTAINER_TENSORRT: Final[Mapping[str, str]] = MappingProxyType(
    {r.image: r.tensorrt for r in CONTAINER_ROWS if r.tensorrt})
#: Container tag -> TensorRT-LLM version inside it.
CONTAINER_TRTLLM: Final[Mapping[str, str]] = MappingProxyType({r.image: r.tensorrt_llm for r in CONTAINER_ROWS})


ROLES: Final[ContainerRoles] = _TABLE.roles


def _repository(image: str) -> str:
    return image.split("@", 1)[0].rsplit(":", 1)[0]


def _job_rows() -> Mapping[str, tuple[str, ...]]:
    """TensorRT-LLM version -> the images kiln's jobs run in: the first ``roles.jobs`` repository with rows for it."""
    table: dict[str, tuple[str, ...]] = {}
    for repo in ROLES.jobs:
        for row in CONTAINER_ROWS:
            if _repository(row.image) == repo and (row.tensorrt_llm not in table or
                                                    _repository(table[row.tensorrt_llm][0]) == repo):
                table[row.tensorrt_llm] = table.get(row.tensorrt_llm, ()) + (row.image,)
    return MappingProxyType(table)


#: TensorRT-LLM version -> the images the engine runtime's jobs use (Triton's while one ships it, else TensorRT-LLM's
#: own release image), oldest first.
JOB_CONTAINERS: Final[Mapping[str, tuple[str, ...]]] = _job_rows()
#: The newest TensorRT-LLM a Triton ``tensorrtllm`` (engine) image ships: the last one kiln builds engines with.
LAST_ENGINE_VERSION: Final[str] = next(r.tensorrt_llm for r in reversed(CONTAINER_ROWS)
                                       if "triton-tensorrtllm" in r.stacks)


def version_key(version: str) -> tuple:
    """Orders TensorRT-LLM versions: 1.2.1 < 1.3.0rc29 < 1.3.0 < 1.4.0rc2 (pre-releases before their release)."""
    import re

    m = re.match(r"^(\d+(?:\.\d+)*)(?:\.?(rc|post)\.?(\d+))?", version.strip())
    if not m:
        return ((0,), 0, 0)
    nums = tuple(int(p) for p in m.group(1).split("."))
    rank = {"rc": -1, None: 0, "post": 1}[m.group(2)]
    return (nums, rank, int(m.group(3) or 0))


def has_engine_path(version: str) -> bool:
    """Whether kiln builds TensorRT engines with TensorRT-LLM ``version`` (none after :data:`LAST_ENGINE_VERSION`:
    upstream removed the engine path and Triton's tensorrtllm backend during the 1.3 pre-releases)."""
    return version_key(version) <= version_key(LAST_ENGINE_VERSION)


def dynamo_image_for(trtllm_version: str) -> Optional[str]:
    """The newest Dynamo TensorRT-LLM runtime image pinning ``trtllm_version`` (None when the table has none)."""
    found = [r.image for r in CONTAINER_ROWS
             if _repository(r.image) in ROLES.dynamo and r.tensorrt_llm == trtllm_version.strip()]
    return found[-1] if found else None


def row_for(image: str) -> Optional[ContainerRow]:
    """The table's row for ``image`` (a digest suffix is ignored); None when the table does not know it."""
    tag = strip_digest(image)
    return next((r for r in CONTAINER_ROWS if r.image == tag), None)


def container_for(trtllm_version: str) -> str:
    """Newest image kiln's jobs use for ``trtllm_version``: a ``tritonserver:<yy.mm>-trtllm-python-py3`` tag while one
    ships it, else TensorRT-LLM's own ``tensorrt-llm/release:<version>`` (see the table's ``roles``).

    Raises ``LookupError`` listing the known versions when none ships it.
    """
    tags = JOB_CONTAINERS.get(trtllm_version.strip())
    if not tags:
        raise LookupError(f"no container in kiln's table is known to ship TensorRT-LLM {trtllm_version!r}; known "
                          f"versions: {', '.join(JOB_CONTAINERS)}")
    return tags[-1]


def tensorrt_for(trtllm_version: str) -> Optional[str]:
    """The TensorRT version the table's containers pair with ``trtllm_version`` (None when unknown or when the
    containers that ship it disagree)."""
    found = {CONTAINER_TENSORRT[t] for t in NGC_CONTAINERS.get(trtllm_version.strip(), ())}
    return found.pop() if len(found) == 1 else None


def strip_digest(image: str) -> str:
    """``repo:tag@sha256:…`` → ``repo:tag`` (the table is keyed by tag)."""
    return image.split("@", 1)[0]
