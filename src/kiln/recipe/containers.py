"""NVIDIA's serving containers and what each ships: one table that picks both the engine runtime image (where
TensorRT-LLM quantizes and builds) and the serving container (where the engine runs), because an engine only
loads in a container with the same TensorRT-LLM and TensorRT that built it.

The facts live in ``data/trtllm_containers.json`` (source: triton-inference-server/server
``docs/introduction/compatibility.md``, commit in the file). A malformed file fails at import, naming the key.
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


class _ContainersFile(_Data):
    about: str
    source: ContainerSource
    repository: str
    suffix: str
    columns: tuple[Literal["release"], Literal["tensorrt_llm"], Literal["tensorrt"]]
    rows: tuple[tuple[str, str, str], ...]


def _load() -> _ContainersFile:
    text = (resources.files("kiln.recipe") / "data" / CONTAINERS_FILE).read_text(encoding="utf-8")
    try:
        return _ContainersFile.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise ValueError(f"{CONTAINERS_FILE}: {problems}") from None


_TABLE: Final = _load()
CONTAINERS_SOURCE: Final[ContainerSource] = _TABLE.source
CONTAINER_REPOSITORY: Final[str] = _TABLE.repository
CONTAINER_SUFFIX: Final[str] = _TABLE.suffix


def _tag(release: str) -> str:
    return f"{CONTAINER_REPOSITORY}:{release}{CONTAINER_SUFFIX}"


def _by_version() -> Mapping[str, tuple[str, ...]]:
    table: dict[str, list[str]] = {}
    for release, trtllm, _tensorrt in _TABLE.rows:
        table.setdefault(trtllm, []).append(_tag(release))
    return MappingProxyType({version: tuple(tags) for version, tags in table.items()})


#: TensorRT-LLM version -> container tags that ship it, oldest first.
NGC_CONTAINERS: Final[Mapping[str, tuple[str, ...]]] = _by_version()
#: Container tag -> TensorRT version inside it (an engine must be built with the same one).
CONTAINER_TENSORRT: Final[Mapping[str, str]] = MappingProxyType(
    {_tag(release): tensorrt for release, _trtllm, tensorrt in _TABLE.rows})
#: Container tag -> TensorRT-LLM version inside it.
CONTAINER_TRTLLM: Final[Mapping[str, str]] = MappingProxyType(
    {_tag(release): trtllm for release, trtllm, _tensorrt in _TABLE.rows})


def container_for(trtllm_version: str) -> str:
    """Newest ``tritonserver:<yy.mm>-trtllm-python-py3`` tag shipping ``trtllm_version``.

    Raises ``LookupError`` listing the known versions when none ships it.
    """
    tags = NGC_CONTAINERS.get(trtllm_version.strip())
    if not tags:
        raise LookupError(f"no {CONTAINER_REPOSITORY}:*{CONTAINER_SUFFIX} container is known to ship TensorRT-LLM "
                          f"{trtllm_version!r}; known versions: {', '.join(NGC_CONTAINERS)}")
    return tags[-1]


def tensorrt_for(trtllm_version: str) -> Optional[str]:
    """The TensorRT version the table's containers pair with ``trtllm_version`` (None when unknown or when the
    containers that ship it disagree)."""
    found = {CONTAINER_TENSORRT[t] for t in NGC_CONTAINERS.get(trtllm_version.strip(), ())}
    return found.pop() if len(found) == 1 else None


def strip_digest(image: str) -> str:
    """``repo:tag@sha256:…`` → ``repo:tag`` (the table is keyed by tag)."""
    return image.split("@", 1)[0]
