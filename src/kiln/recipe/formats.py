"""The quantization format registry: which weight and KV-cache formats exist, and every fact about them.

The facts live in one data file, ``kiln/recipe/data/formats.yaml`` (each with its upstream source); this module
loads it once, validates it into typed frozen objects (a bad entry stops kiln at start-up naming the key) and
answers the questions the readers ask:

- the schema: the format names (``weight_format_names``) and their labels;
- the rules, the planner and the engine step: does a format run on a target and GPU, and if not, why and what to
  use instead (:func:`format_refusal`, :func:`kv_refusal`, :func:`why_unsupported`);
- the planner: bytes per weight and the GEMM type (:meth:`WeightFormat.bytes_per_weight`, ``storage.gemm``);
- the quantize step: the ModelOpt preset and what the TensorRT-LLM checkpoint must say;
- the quality gate: gentler formats (:func:`gentler_alternatives`).

Adding a format is one entry in the data file; adding a target is one ``targets`` entry plus a ``support`` entry
per format. Nothing here names a format.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.recipe.gpus import GPUS

__all__ = [
    "pytorch_release_formats",
    "release_refusal",
    "Registry",
    "WeightFormat",
    "KVCacheFormat",
    "Target",
    "Refusal",
    "UnknownFormat",
    "registry",
    "load_registry",
    "weight_format",
    "kv_cache_format",
    "weight_format_names",
    "kv_cache_format_names",
    "target_names",
    "format_refusal",
    "kv_refusal",
    "why_unsupported",
    "gentler_alternatives",
    "formats_that_run",
    "kv_formats_that_run",
    "gpus_that_run",
    "kv_format_for_quant_algo",
]

DATA_FILE = "formats.yaml"


class UnknownFormat(LookupError):
    """A name the registry does not hold; the message lists the known ones."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Source(_Frozen):
    """Where a fact comes from: repository, path, commit, and what it says."""

    repo: str
    path: str
    commit: str
    title: str
    what: str

    def cite(self) -> str:
        return f"{self.title} ({self.repo} {self.path} @ {self.commit.split()[0][:12]})"


class MinSM(_Frozen):
    sm: Annotated[int, Field(ge=0)]
    source: str
    note: str


class RefusedRange(_Frozen):
    """Refused on compute capabilities ``sm[0] <= sm < sm[1]`` (``sm[1]`` null: no upper bound)."""

    sm: tuple[int, Optional[int]]
    by: str
    why: str
    source: str

    def covers(self, sm: int) -> bool:
        lo, hi = self.sm
        return lo <= sm and (hi is None or sm < hi)

    def span(self) -> str:
        lo, hi = self.sm
        return f"SM {lo}+" if hi is None else f"SM {lo}-{hi - 1}"


class Unsupported(_Frozen):
    why: str
    source: str


class TargetSupport(_Frozen):
    """What one target needs of the GPU to run a format."""

    min_sm: Optional[MinSM] = None
    refused: tuple[RefusedRange, ...] = ()
    unsupported: Optional[Unsupported] = None


class Scale(_Frozen):
    """A scale stored per group of weights: ``bytes`` of ``dtype`` for every ``every`` weights."""

    bytes: float
    dtype: str
    every: Union[Annotated[int, Field(ge=1)], Literal["awq_block_size"]]


class Storage(_Frozen):
    weight_bytes: Optional[float] = None
    weight_dtype: Optional[str] = None
    scale: Optional[Scale] = None
    scales_not_counted: Optional[str] = None
    gemm: Literal["base", "fp8", "int8", "fp4"]


class Calibration(_Frozen):
    algorithm: Optional[Literal["smoothquant"]] = None
    max_samples: Optional[Annotated[int, Field(ge=1)]] = None


class Target(_Frozen):
    name: str = ""
    label: str
    device: Literal["cuda", "cpu"]


class EngineFakeQuant(_Frozen):
    """The engine runtime's ModelOpt preset (with edits) that reproduces what trtllm-build does to the weights of a
    format it quantizes itself, for the quality gate."""

    preset: str
    disable: tuple[str, ...] = ()
    per_channel: bool = False
    source: str


class UnifiedLayout(_Frozen):
    """How ModelOpt's unified Hugging Face checkpoint stores a weight format's linear layers (target pytorch), for
    kiln's CPU reference runtime: the weight encoding, an FP8 activation step (input_scale), an FP8 step of the
    dequantized weight (weight_scale_2)."""

    weights: Literal["fp8", "int4_packed"]
    activations: Optional[Literal["fp8"]] = None
    weight_fp8_step: bool = False
    source: str


class UnifiedKV(_Frozen):
    """How the unified checkpoint's KV cache rounds keys and values (k_scale / v_scale)."""

    rounding: Literal["fp8"]
    source: str


class _Format(_Frozen):
    name: str = ""
    label: str
    modelopt_config: Optional[str]
    fake_quant_needs_cuda: Optional[Unsupported] = None
    gentler: tuple[str, ...] = ()
    support: dict[str, TargetSupport]


class WeightFormat(_Format):
    """One weight format (see the header of formats.yaml for the meaning of each field)."""

    description: str
    trtllm_qformat: str
    quant_algo: Optional[str]
    storage: Storage
    calibration: Calibration = Calibration()
    modelopt_weight_scales: Optional[Literal["per_channel"]] = None
    trtllm_quantizes_weights: bool = False
    engine_fake_quant: Optional[EngineFakeQuant] = None
    fp8_context_fmha: bool = False
    unified: Optional[UnifiedLayout] = None

    @property
    def uses_awq_block_size(self) -> bool:
        """Whether the recipe's ``quantization.awq_block_size`` sets this format's scale groups."""
        return self.storage.scale is not None and self.storage.scale.every == "awq_block_size"

    def _scale_every(self, awq_block_size: int) -> int:
        assert self.storage.scale is not None
        every = self.storage.scale.every
        return awq_block_size if every == "awq_block_size" else every

    def bytes_per_weight(self, base_bytes: int, awq_block_size: int) -> float:
        """Bytes stored per weight element, scales that grow with the element count included."""
        if self.storage.weight_bytes is None:
            return float(base_bytes)
        if self.storage.scale is None:
            return self.storage.weight_bytes
        return self.storage.weight_bytes + self.storage.scale.bytes / self._scale_every(awq_block_size)

    def basis(self, base_dtype: str, base_bytes: int, awq_block_size: int) -> str:
        """How :meth:`bytes_per_weight` is made up, in words."""
        s = self.storage
        value = self.bytes_per_weight(base_bytes, awq_block_size)
        if s.weight_bytes is None:
            return f"{base_dtype}: {base_bytes} bytes per weight"
        text = f"{self.name}: {s.weight_bytes:g} byte ({s.weight_dtype})"
        if s.scale is not None:
            every = self._scale_every(awq_block_size)
            text += f" + one {s.scale.dtype} scale per {every} weights ({s.scale.bytes:g}/{every})"
        text += f" = {value:g} bytes per weight"
        if s.scales_not_counted:
            text += f"; not counted: {s.scales_not_counted}"
        return text


class KVCacheFormat(_Format):
    """One KV-cache format."""

    kv_cache_quant_algo: Optional[str]
    modelopt_num_bits: Optional[int] = None
    trtllm_kv_cache_dtype: Optional[str]
    bytes_per_element: Optional[int]
    disables_paged_context_fmha: bool = False
    unified: Optional[UnifiedKV] = None


class QuantAlgos(_Frozen):
    source: str
    members: tuple[str, ...]
    kv_cache_only: tuple[str, ...]
    kv_cache_quant_algos: tuple[str, ...]

    @property
    def quant_algos(self) -> frozenset[str]:
        """What a checkpoint's ``quant_algo`` may say (QUANT_ALGO_LIST), besides null."""
        return frozenset(self.members) - frozenset(self.kv_cache_only)


class Dropped(_Frozen):
    """A format a release's PyTorch backend no longer runs."""

    format: str
    why: str


class PytorchRelease(_Frozen):
    """The formats one TensorRT-LLM release's PyTorch backend runs: the pinned release's are the ``support.pytorch``
    entries; a later one is ``same_as`` another minus what it ``drops``."""

    verified: bool
    source: str
    note: str
    same_as: Optional[str] = None
    drops: tuple[Dropped, ...] = ()
    drops_kv: tuple[Dropped, ...] = ()


class Registry(_Frozen):
    """The whole data file, validated: every cross-reference resolves and every format covers every target."""

    pinned: dict[str, str]
    sources: dict[str, Source]
    targets: dict[str, Target]
    weight_formats: dict[str, WeightFormat]
    kv_cache_formats: dict[str, KVCacheFormat]
    trtllm_quant_algos: QuantAlgos
    pytorch_releases: dict[str, PytorchRelease]

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: object) -> object:
        """Each entry learns its own key as its name."""
        if isinstance(data, dict):
            data = dict(data)
            for table in ("targets", "weight_formats", "kv_cache_formats"):
                if isinstance(data.get(table), dict):
                    data[table] = {k: {**v, "name": k} if isinstance(v, dict) else v
                                   for k, v in data[table].items()}
        return data

    @model_validator(mode="after")
    def _cross_references(self) -> Registry:
        problems: list[str] = []
        algos = self.trtllm_quant_algos
        if algos.source not in self.sources:
            problems.append(f"trtllm_quant_algos.source: unknown source {algos.source!r}")
        for table, formats in (("weight_formats", self.weight_formats), ("kv_cache_formats", self.kv_cache_formats)):
            if "none" not in formats:
                problems.append(f"{table}: needs a 'none' entry (no quantization)")
            for name, fmt in formats.items():
                key = f"{table}.{name}"
                problems += [f"{key}.gentler: unknown format {g!r}" for g in fmt.gentler if g not in formats]
                problems += [f"{key}.support: no entry for target {t!r} (write `{t}: {{}}` if it runs everywhere)"
                             for t in self.targets if t not in fmt.support]
                problems += [f"{key}.support.{t}: unknown target (known: {', '.join(self.targets)})"
                             for t in fmt.support if t not in self.targets]
                cuda = [fmt.fake_quant_needs_cuda.source] if fmt.fake_quant_needs_cuda else []
                engine_fq = getattr(fmt, "engine_fake_quant", None)
                if getattr(fmt, "trtllm_quantizes_weights", False) and engine_fq is None:
                    problems.append(f"{key}.engine_fake_quant: needed (trtllm-build quantizes these weights, and "
                                    "the engine runtime's quality gate must reproduce it)")
                cuda += [engine_fq.source] if engine_fq else []
                unified = getattr(fmt, "unified", None)
                if unified is not None and unified.source not in self.sources:
                    problems.append(f"{key}.unified: unknown source {unified.source!r}")
                problems += [f"{key}.fake_quant_needs_cuda: unknown source {s!r}"
                             for s in cuda if s not in self.sources]
                for target, sup in fmt.support.items():
                    cited = ([sup.min_sm.source] if sup.min_sm else []) + [r.source for r in sup.refused] \
                        + ([sup.unsupported.source] if sup.unsupported else [])
                    problems += [f"{key}.support.{target}: unknown source {s!r}"
                                 for s in cited if s not in self.sources]
                    problems += [f"{key}.support.{target}.refused: empty SM range {r.sm}" for r in sup.refused
                                 if r.sm[1] is not None and r.sm[1] <= r.sm[0]]
            algo_field, valid = (("quant_algo", algos.quant_algos) if table == "weight_formats"
                                 else ("kv_cache_quant_algo", frozenset(algos.kv_cache_quant_algos)))
            for name, fmt in formats.items():
                value = getattr(fmt, algo_field)
                if value is not None and value not in valid:
                    problems.append(f"{table}.{name}.{algo_field}: {value!r} is not one TensorRT-LLM "
                                    f"{self.pinned.get('tensorrt_llm', '')} accepts")
        pinned = self.pinned.get("tensorrt_llm")
        if pinned not in self.pytorch_releases or self.pytorch_releases[pinned].same_as is not None:
            problems.append(f"pytorch_releases: needs an entry for the pinned release {pinned!r} without same_as")
        for version, rel in self.pytorch_releases.items():
            key = f"pytorch_releases.{version}"
            if rel.source not in self.sources:
                problems.append(f"{key}.source: unknown source {rel.source!r}")
            if rel.same_as is not None and rel.same_as not in self.pytorch_releases:
                problems.append(f"{key}.same_as: unknown release {rel.same_as!r}")
            problems += [f"{key}.drops: unknown weight format {d.format!r}" for d in rel.drops
                         if d.format not in self.weight_formats]
            problems += [f"{key}.drops_kv: unknown KV-cache format {d.format!r}" for d in rel.drops_kv
                         if d.format not in self.kv_cache_formats]
        if problems:
            raise ValueError("; ".join(problems))
        return self


def load_registry(text: str, origin: str = DATA_FILE) -> Registry:
    """Parse and validate registry YAML; ValueError naming the origin and each bad key otherwise."""
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        return Registry.model_validate(data)
    except yaml.YAMLError as exc:
        raise ValueError(f"{origin}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()]
        raise ValueError(f"{origin}: invalid format registry:\n  " + "\n  ".join(lines)) from None


@functools.cache
def registry() -> Registry:
    """The registry shipped with kiln (loaded and validated once)."""
    text = resources.files("kiln.recipe").joinpath("data", DATA_FILE).read_text(encoding="utf-8")
    return load_registry(text, f"kiln/recipe/data/{DATA_FILE}")


# ------------------------------------------------------------------------------------------- lookups


def _lookup(table: Mapping[str, object], name: str, what: str) -> object:
    try:
        return table[name]
    except KeyError:
        raise UnknownFormat(f"unknown {what} {name!r}; known {what}s: {', '.join(table)}") from None


def weight_format(name: str) -> WeightFormat:
    return _lookup(registry().weight_formats, name, "weight format")  # type: ignore[return-value]


def kv_cache_format(name: str) -> KVCacheFormat:
    return _lookup(registry().kv_cache_formats, name, "kv_cache format")  # type: ignore[return-value]


def target(name: str) -> Target:
    return _lookup(registry().targets, name, "target")  # type: ignore[return-value]


def weight_format_names() -> tuple[str, ...]:
    return tuple(registry().weight_formats)


def kv_cache_format_names() -> tuple[str, ...]:
    return tuple(registry().kv_cache_formats)


def target_names() -> tuple[str, ...]:
    return tuple(registry().targets)


def kv_format_for_quant_algo(kv_cache_quant_algo: Optional[str]) -> Optional[KVCacheFormat]:
    """The KV-cache format whose checkpoint says ``kv_cache_quant_algo`` (case-insensitive; None if unknown)."""
    want = kv_cache_quant_algo.upper() if isinstance(kv_cache_quant_algo, str) else None
    return next((f for f in registry().kv_cache_formats.values()
                 if (f.kv_cache_quant_algo or None) == (want or None)), None)


# ------------------------------------------------------------------------------------------- support


@dataclass(frozen=True)
class Refusal:
    """Why a format does not run on a target/GPU (``reason``), what to do instead (``hint``), and the source."""

    reason: str
    hint: str
    source: str

    def __str__(self) -> str:
        return f"{self.reason}; {self.hint}" if self.hint else self.reason


def _reason(fmt: _Format, target_name: str, sm: Optional[int], gpu_name: Optional[str]) -> Optional[tuple[str, str]]:
    """(reason, source id) when ``fmt`` cannot run on ``target_name`` with a GPU of compute capability ``sm``
    (None: not known, so only checks that do not depend on the GPU apply)."""
    tgt = target(target_name)
    sup = fmt.support[target_name]
    where = f"{gpu_name} is SM {sm}" if gpu_name else f"this GPU is SM {sm}"
    if sup.unsupported is not None:
        return f"the {target_name} target does not run {fmt.label} ({sup.unsupported.why})", sup.unsupported.source
    if tgt.device == "cpu":
        cuda = fmt.fake_quant_needs_cuda
        if cuda is not None:
            return f"{cuda.why}; the {target_name} target runs on CPU", cuda.source
        return None
    if sm is None:
        return None
    if sup.min_sm is not None and sm < sup.min_sm.sm:
        return (f"{fmt.label} needs SM {sup.min_sm.sm}+ but {where} ({registry().sources[sup.min_sm.source].title}: "
                f"{sup.min_sm.note})", sup.min_sm.source)
    for refused in sup.refused:
        if refused.covers(sm):
            return (f"{refused.by} refuses {fmt.label} on {refused.span()} ({refused.why}); {where}",
                    refused.source)
    return None


def _runs(fmt: _Format, target_name: str, sm: Optional[int]) -> bool:
    return _reason(fmt, target_name, sm, None) is None


def formats_that_run(target_name: str, sm: Optional[int]) -> list[str]:
    """Weight formats that run on ``target_name`` with a GPU of compute capability ``sm``, registry order."""
    return [f.name for f in registry().weight_formats.values() if _runs(f, target_name, sm)]


def kv_formats_that_run(target_name: str, sm: Optional[int]) -> list[str]:
    return [f.name for f in registry().kv_cache_formats.values() if _runs(f, target_name, sm)]


def gpus_that_run(target_name: str, weight: str = "none", kv: str = "none") -> list[str]:
    """GPUs of kiln's GPU table on which ``target_name`` runs the weight format and the KV-cache format."""
    w, k = weight_format(weight), kv_cache_format(kv)
    return [g.name for g in GPUS.values() if _runs(w, target_name, g.sm) and _runs(k, target_name, g.sm)]


def _gentler(table: Mapping[str, _Format], name: str, target_name: str, sm: Optional[int]) -> list[str]:
    """Gentler formats that run here: the direct ones first, then theirs (breadth first)."""
    found: list[str] = []
    queue, seen = list(table[name].gentler), {name}
    while queue:
        candidate = queue.pop(0)
        if candidate in seen:
            continue
        seen.add(candidate)
        if _runs(table[candidate], target_name, sm):
            found.append(candidate)
        else:
            queue.extend(table[candidate].gentler)
    return found


def gentler_alternatives(name: str, target_name: str, sm: Optional[int] = None) -> list[str]:
    """Gentler weight formats than ``name`` that run on the target (and GPU, when ``sm`` is known)."""
    return _gentler(registry().weight_formats, name, target_name, sm)


def _size(fmt: _Format) -> float:
    """Bytes per element, for ranking alternatives (a 2-byte model dtype and AWQ block 128 as the yardstick)."""
    if isinstance(fmt, WeightFormat):
        return fmt.bytes_per_weight(2, 128)
    return float(getattr(fmt, "bytes_per_element", None) or 2)


def _instead(table: Mapping[str, _Format], name: str, here: list[str], target_name: str,
             sm: Optional[int]) -> list[str]:
    """What to use instead of ``name``, best first: gentler quantized formats that run here, then the other
    quantized ones closest in size, then no quantization."""
    gentler = [g for g in _gentler(table, name, target_name, sm) if g != "none"]
    size = _size(table[name])
    closest = sorted((n for n in here if n != "none" and n not in gentler), key=lambda n: abs(_size(table[n]) - size))
    return gentler + closest + [n for n in here if n == "none"]


def _refusal(table: Mapping[str, _Format], kind: str, name: str, target_name: str, sm: Optional[int],
             gpu_name: Optional[str]) -> Optional[Refusal]:
    fmt = table[name]
    found = _reason(fmt, target_name, sm, gpu_name)
    if found is None:
        return None
    reason, source = found
    here = [f.name for f in table.values() if _runs(f, target_name, sm)]
    options = _instead(table, name, here, target_name, sm)
    on = (f"{gpu_name} on {target_name}" if gpu_name else f"SM {sm} on {target_name}" if sm is not None
          else f"the {target_name} target")
    hint = f"use {kind}: {options[0]} instead ({on} runs {', '.join(here)})" if options else ""
    if target(target_name).device == "cuda" and fmt.support[target_name].unsupported is None:
        weight, kv = (name, "none") if kind == "quantization.format" else ("none", name)
        gpus = gpus_that_run(target_name, weight, kv)
        hint += f", or a GPU that runs {name}: {', '.join(gpus) if gpus else 'none in kiln GPU table'}"
    elif target(target_name).device == "cuda":  # no GPU helps: name the targets that do run it
        others = [t for t in registry().targets if t != target_name and fmt.support[t].unsupported is None
                  and registry().targets[t].device == "cuda"]
        if others:
            hint += f", or target: {' / '.join(others)}"
    else:
        others = [t for t in registry().targets if t != target_name and fmt.support[t].unsupported is None
                  and (registry().targets[t].device == "cuda" or fmt.fake_quant_needs_cuda is None)]
        if others:
            hint += f", or target: {' / '.join(others)}"
    return Refusal(reason, hint.lstrip(", "), source)


def format_refusal(name: str, target_name: str, sm: Optional[int] = None,
                   gpu_name: Optional[str] = None) -> Optional[Refusal]:
    """Why weight format ``name`` does not run on ``target_name`` with a GPU of compute capability ``sm``
    (None: GPU unknown), and what to use instead; None when it runs."""
    return _refusal(registry().weight_formats, "quantization.format", name, target_name, sm, gpu_name)


def kv_refusal(name: str, target_name: str, sm: Optional[int] = None,
               gpu_name: Optional[str] = None) -> Optional[Refusal]:
    """Like :func:`format_refusal`, for a KV-cache format."""
    return _refusal(registry().kv_cache_formats, "quantization.kv_cache", name, target_name, sm, gpu_name)


def why_unsupported(name: str, target_name: str, sm: Optional[int] = None) -> Optional[str]:
    """The reason weight format ``name`` does not run on ``target_name`` at SM ``sm``, with the alternatives;
    None when it runs."""
    found = format_refusal(name, target_name, sm)
    return None if found is None else str(found)


def pytorch_release_formats(version: str, reg: Optional[Registry] = None) -> Optional[tuple[tuple[str, ...],
                                                                                          tuple[str, ...]]]:
    """(weight formats, KV-cache formats) TensorRT-LLM ``version``'s PyTorch backend runs, registry order; None when
    the registry has no entry for the release."""
    reg = reg or registry()
    rel = reg.pytorch_releases.get(version)
    if rel is None:
        return None
    if rel.same_as is None:
        base = ([f.name for f in reg.weight_formats.values() if f.support["pytorch"].unsupported is None],
                [f.name for f in reg.kv_cache_formats.values() if f.support["pytorch"].unsupported is None])
    else:
        found = pytorch_release_formats(rel.same_as, reg)
        assert found is not None  # the registry checks same_as
        base = (list(found[0]), list(found[1]))
    dropped, dropped_kv = {d.format for d in rel.drops}, {d.format for d in rel.drops_kv}
    return (tuple(n for n in base[0] if n not in dropped), tuple(n for n in base[1] if n not in dropped_kv))


def release_refusal(weight: str, kv: str, version: str, reg: Optional[Registry] = None) -> list[tuple[str, Refusal]]:
    """(recipe key, refusal) for each of the weight and KV-cache formats TensorRT-LLM ``version``'s PyTorch backend
    does not run by the registry's ``pytorch_releases`` (a release without an entry refuses both), naming the
    release. Formats no release runs on target pytorch are :func:`format_refusal`'s to explain, not this one's."""
    reg = reg or registry()
    found = pytorch_release_formats(version, reg)
    if found is None:
        known = ", ".join(reg.pytorch_releases)
        return [("engine_runtime.trtllm_version",
                 Refusal(f"kiln does not know which formats TensorRT-LLM {version}'s PyTorch backend runs "
                         "(formats.yaml pytorch_releases)",
                         f"use a release with an entry ({known}), or add one with its source", "pytorch_releases"))]
    rel = reg.pytorch_releases[version]
    out = []
    for key, name, table, runs, drops in (
            ("quantization.format", weight, reg.weight_formats, found[0], rel.drops),
            ("quantization.kv_cache", kv, reg.kv_cache_formats, found[1], rel.drops_kv)):
        if name in runs or table[name].support["pytorch"].unsupported is not None:
            continue
        why = next((d.why for d in drops if d.format == name), "dropped by the release it is the same as")
        label = "weight" if key == "quantization.format" else "KV-cache"
        out.append((key, Refusal(f"TensorRT-LLM {version}'s PyTorch backend does not run {table[name].label} "
                                 f"({why}; source: {reg.sources[rel.source].title})",
                                 f"use {key}: one of {', '.join(runs)} ({label} formats {version} runs), or "
                                 "another engine_runtime.trtllm_version", rel.source)))
    return out
