"""The Triton model-repository contract of TensorRT-LLM's ``inflight_batcher_llm`` layout, loaded from data.

Five models: ``preprocessing`` (Python, tokenizer) -> ``tensorrt_llm`` (C++ backend ``tensorrtllm``) ->
``postprocessing`` (Python, detokenizer), wired by the ``ensemble``; ``tensorrt_llm_bls`` is the Python
alternative to the ensemble (and drives draft/target speculative decoding). kiln writes these configs itself;
this module says what upstream declares so that kiln's repositories keep the tensor names, types and shapes
that existing clients rely on.

The facts live in data files beside this module, each naming its sources (repository, path, commit):

* ``data/inflight_batcher_llm.json``: every model's tensors, parameters, template variables and (ensemble)
  wiring, from ``NVIDIA/TensorRT-LLM`` ``triton_backend/all_models/inflight_batcher_llm/*/config.pbtxt``;
  parameter semantics and backend defaults from ``triton-inference-server/tensorrtllm_backend``.
* the container table (``tritonserver:<yy.mm>-trtllm-python-py3`` and the TensorRT-LLM / TensorRT each ships)
  lives in :mod:`kiln.recipe.containers`, which picks the engine runtime image too; it is re-exported here.

This module only types them (:class:`ModelContract`, :class:`TensorSpec`, ...) and answers questions about
them (:func:`container_for`). A malformed data file fails at import with the file and the key path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Final, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kiln.recipe.containers import (  # noqa: F401 - re-exported: the container table's one home is there
    CONTAINER_REPOSITORY,
    CONTAINER_SUFFIX,
    CONTAINER_TENSORRT,
    CONTAINERS_SOURCE,
    NGC_CONTAINERS,
    container_for,
)

CONTRACT_FILE: Final = "inflight_batcher_llm.json"


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a model config.

    ``data_type`` is a Triton type name (``TYPE_INT32``, ``TYPE_STRING``, ...) or, where
    upstream leaves it to a template variable, that placeholder verbatim (for example
    ``"${logits_datatype}"``; see :data:`TEMPLATED_DATA_TYPES`).  ``dims`` exclude the
    batch dimension (every model has ``max_batch_size`` > 0).  ``reshape == ()`` is
    upstream's ``reshape: { shape: [ ] }`` (a ``[1]`` tensor seen as a scalar).
    """

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    allow_ragged_batch: bool = False

    @property
    def template_var(self) -> str | None:
        """The template variable naming this tensor's type, if upstream templates it."""
        if self.data_type.startswith("${") and self.data_type.endswith("}"):
            return self.data_type[2:-1]
        return None


ParamKind = Literal["str", "path", "int", "float", "bool", "choice", "fixed"]


@dataclass(frozen=True)
class ParameterSpec:
    """One ``parameters { key: ... value: { string_value: ... } }`` entry.

    All values are strings on the wire.  ``template_var`` is the ``${...}`` upstream
    puts there (``None`` for fixed values); ``default`` is what the consumer uses when
    the key is absent or its value cannot be parsed (an unfilled ``${...}`` included),
    ``None`` when there is no default (absent means "unset" or the load fails, see
    ``required``).  ``allowed`` lists accepted spellings for ``choice``/``bool``.
    """

    key: str
    kind: ParamKind
    template_var: str | None = None
    default: str | None = None
    allowed: tuple[str, ...] | None = None
    required: bool = False
    fixed_value: str | None = None
    help: str = ""


@dataclass(frozen=True)
class EnsembleStep:
    """One ``ensemble_scheduling.step``: ``(model tensor, ensemble tensor)`` pairs, in file order."""

    model_name: str
    input_map: tuple[tuple[str, str], ...]
    output_map: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Source:
    """Where a fact was read: repository, path in it, and commit (or branch/tag where no commit is pinned)."""

    repo: str
    path: str
    commit: str
    note: str = ""

    def __str__(self) -> str:
        return f"{self.repo} {self.path} @ {self.commit}"


@dataclass(frozen=True)
class ModelContract:
    """What upstream's ``config.pbtxt`` for one model declares."""

    name: str
    backend: str | None
    platform: str | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: Mapping[str, ParameterSpec]
    template_vars: frozenset[str]
    decoupled: Literal["templated", "absent"] = "absent"
    dynamic_batching: bool = False
    steps: tuple[EnsembleStep, ...] = ()
    source: Source | None = None

    def input(self, name: str) -> TensorSpec:
        """The input tensor called ``name``; ``KeyError`` naming the model otherwise."""
        return _find(self.inputs, name, f"{self.name} input")

    def output(self, name: str) -> TensorSpec:
        """The output tensor called ``name``; ``KeyError`` naming the model otherwise."""
        return _find(self.outputs, name, f"{self.name} output")


def _find(specs: tuple[TensorSpec, ...], name: str, what: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise KeyError(f"{what} {name!r} is not in the upstream contract")


# ----------------------------------------------------------------------------------------------- loading
# The files' shapes, checked by pydantic (strict: no coercion, unknown keys refused), then turned into the
# frozen dataclasses above. A malformed file fails at import, naming the file and the key path.


class ContractDataError(ValueError):
    """A data file does not have the expected shape (names the file and the key path)."""


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _SourceData(_Data):
    repo: str
    path: str
    commit: str
    note: str = ""

    def typed(self) -> Source:
        return Source(self.repo, self.path, self.commit, self.note)


class _TensorData(_Data):
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    allow_ragged_batch: bool = False


class _ParameterData(_Data):
    kind: ParamKind
    template_var: str | None = None
    default: str | None = None
    allowed: tuple[str, ...] | str | None = None
    """A list of spellings, or the name of a set in the file's ``spellings``."""
    required: bool = False
    fixed_value: str | None = None
    help: str = ""


class _StepData(_Data):
    model_name: str
    input_map: tuple[tuple[str, str], ...]
    output_map: tuple[tuple[str, str], ...]


class _ModelData(_Data):
    source: _SourceData
    notes: tuple[str, ...] = ()
    backend: str | None
    platform: str | None
    decoupled: Literal["templated", "absent"]
    dynamic_batching: bool
    template_vars: tuple[str, ...]
    added_since_backend_repo: tuple[str, ...]
    added_since_backend_repo_note: str = ""
    inputs: tuple[_TensorData, ...]
    outputs: tuple[_TensorData, ...]
    parameters: dict[str, _ParameterData]
    steps: tuple[_StepData, ...] = ()


class _SpellingsData(_Data):
    values: tuple[str, ...]
    source: str


class _ValuesData(_Data):
    values: tuple[str, ...]
    note: str = ""


class _ContractFile(_Data):
    about: str
    note: str = ""
    sources: dict[str, _SourceData]
    spellings: dict[str, _SpellingsData]
    templated_data_types: dict[str, _ValuesData]
    template_vars: dict[str, str]
    models: dict[str, _ModelData]


_FileT = TypeVar("_FileT", bound=BaseModel)


def _load(name: str, shape: type[_FileT]) -> _FileT:
    return _parse(name, (resources.files("kiln.triton") / "data" / name).read_text(encoding="utf-8"), shape)


def _parse(name: str, text: str, shape: type[_FileT]) -> _FileT:
    try:
        return shape.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ContractDataError(f"{name}: {problems}") from None


def _model(name: str, data: _ModelData, spellings: Mapping[str, tuple[str, ...]]) -> ModelContract:
    def allowed(key: str, value: tuple[str, ...] | str | None) -> tuple[str, ...] | None:
        if not isinstance(value, str):
            return value
        if value not in spellings:
            raise ContractDataError(
                f"{CONTRACT_FILE}: models.{name}.parameters.{key}.allowed: {value!r} names no spelling set "
                f"(known: {', '.join(sorted(spellings))})"
            )
        return spellings[value]

    return ModelContract(
        name=name,
        backend=data.backend,
        platform=data.platform,
        inputs=tuple(TensorSpec(**t.model_dump()) for t in data.inputs),
        outputs=tuple(TensorSpec(**t.model_dump()) for t in data.outputs),
        parameters=MappingProxyType(
            {
                key: ParameterSpec(key=key, **{**p.model_dump(), "allowed": allowed(key, p.allowed)})
                for key, p in data.parameters.items()
            }
        ),
        template_vars=frozenset(data.template_vars),
        decoupled=data.decoupled,
        dynamic_batching=data.dynamic_batching,
        steps=tuple(EnsembleStep(s.model_name, s.input_map, s.output_map) for s in data.steps),
        source=data.source.typed(),
    )


_CONTRACT: Final = _load(CONTRACT_FILE, _ContractFile)
_SPELLINGS: Final = {name: s.values for name, s in _CONTRACT.spellings.items()}

#: Upstream's model contracts by model name (ensemble, preprocessing, tensorrt_llm, postprocessing, tensorrt_llm_bls).
MODELS: Final[Mapping[str, ModelContract]] = MappingProxyType(
    {name: _model(name, m, _SPELLINGS) for name, m in _CONTRACT.models.items()}
)
#: Template variables whose value is a Triton data type, and the values upstream docs use.
TEMPLATED_DATA_TYPES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {name: t.values for name, t in _CONTRACT.templated_data_types.items()}
)
#: Tensors present in the TensorRT-LLM copy but not in tensorrtllm_backend@c2e65b8, by model.
ADDED_SINCE_BACKEND_REPO: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {name: frozenset(m.added_since_backend_repo) for name, m in _CONTRACT.models.items()}
)
#: Template variables that are not parameters (model-level fields), with their meaning.
TEMPLATE_VARS: Final[Mapping[str, str]] = MappingProxyType(dict(_CONTRACT.template_vars))
#: Where the contract and the container table were read (``name -> Source``).
UPSTREAM_SOURCE: Final[Mapping[str, Source]] = MappingProxyType(
    {**{k: v.typed() for k, v in _CONTRACT.sources.items()},
     "containers": Source(CONTAINERS_SOURCE.repo, CONTAINERS_SOURCE.path, CONTAINERS_SOURCE.commit, CONTAINERS_SOURCE.note)}
)

#: An engine's logits dtype (``pretrained_config.logits_dtype``; TensorRT-LLM's runtime allows these two and reads
#: float32 when absent) → the Triton type its logits tensors must be declared with (upstream templates it as
#: ``${logits_datatype}``; a declared type that disagrees returns garbage or trips the backend's assert).
LOGITS_TRITON_TYPE: Final[Mapping[str, str]] = MappingProxyType({"float32": "TYPE_FP32", "float16": "TYPE_FP16"})
