"""The ``trtllm-build`` command line of TensorRT-LLM 1.2.x: the flag table and one small checker.

The table is data mirrored from upstream, with its sources, in ``kiln/steps/data/trtllm_build_flags.yaml``;
this module loads it into :class:`FlagSpec` objects and offers :func:`check_flags`, so that kiln can refuse a
build command that upstream would reject (unknown flag, bad choice, missing value) before it reaches a GPU
machine. The quant_algo values a checkpoint may carry, and which GPUs run them, are in the format registry
(:mod:`kiln.recipe.formats`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any, Final, Literal, Optional

import yaml
from pydantic import TypeAdapter, ValidationError

DATA_FILE = "trtllm_build_flags.yaml"

FlagKind = Literal["int", "str", "path", "choice", "bool_enable_disable", "store_true"]


@dataclass(frozen=True)
class FlagSpec:
    """One ``trtllm-build`` flag as upstream's argparse declares it.

    ``default`` is the argparse default verbatim: ``None`` where upstream has none,
    :data:`SUPPRESSED` where upstream uses ``argparse.SUPPRESS``, and the strings
    ``"enable"``/``"disable"`` for plugin switches (they are strings on the command
    line, turned into booleans later by ``PluginConfig``).
    """

    name: str
    kind: FlagKind
    default: Any = None
    choices: Optional[tuple[str, ...]] = None
    help: str = ""
    aliases: tuple[str, ...] = ()
    nargs: Optional[Literal["+"]] = None
    group: str = "general"
    deprecated: Optional[str] = None

    @property
    def takes_value(self) -> bool:
        """Whether the flag consumes the next command-line token(s)."""
        return self.kind != "store_true"


def _load() -> dict[str, Any]:
    text = resources.files("kiln.steps").joinpath("data", DATA_FILE).read_text(encoding="utf-8")
    data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    entries = [dict(e) for e in data["flags"]]
    for entry in entries:
        if entry["kind"] == "bool_enable_disable":
            entry.setdefault("choices", data["enable_disable"])
    try:
        flags = TypeAdapter(list[FlagSpec]).validate_python(entries)
    except ValidationError as exc:
        raise ValueError(f"kiln/steps/data/{DATA_FILE}: invalid flag table: {exc}") from None
    return {**data, "flags": flags}


_DATA: Final = _load()

#: Where the table comes from (repo, path, commit), and the version it mirrors.
TRTLLM_VERSION_SOURCE: Final[Mapping[str, Any]] = MappingProxyType(
    {"version": str(_DATA["version"]), **_DATA["sources"]}
)
#: argparse's own sentinel (``argparse.SUPPRESS``): "no default at all".
SUPPRESSED: Final[str] = _DATA["suppressed"]
ENABLE_DISABLE: Final = tuple(_DATA["enable_disable"])
BUILD_FLAGS: Final[Mapping[str, FlagSpec]] = MappingProxyType({f.name: f for f in _DATA["flags"]})
_HELP_FLAGS: Final = frozenset({"-h", "--help"})
ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {alias: spec.name for spec in BUILD_FLAGS.values() for alias in spec.aliases}
)
#: Flags people still copy from older guides (none accepted by trtllm-build 1.2.1) → the fix.
REMOVED_FLAGS: Final[Mapping[str, str]] = MappingProxyType(dict(_DATA["removed_flags"]))
#: PluginConfig.validate(): plugins refused on exactly SM 100.
SM_100_UNSUPPORTED_PLUGIN_FLAGS: Final = frozenset(_DATA["sm_100_unsupported_plugin_flags"])
#: builder.build(): FP8 context FMHA is switched off (with a warning, not an error) below this SM.
FP8_CONTEXT_FMHA_MIN_SM: Final[int] = int(_DATA["fp8_context_fmha_min_sm"])


def canonical_flag(name: str) -> str | None:
    """Return the primary spelling of ``name`` (resolving aliases), or ``None`` if unknown."""
    if name in BUILD_FLAGS:
        return name
    return ALIASES.get(name)


def _unknown_flag_problem(name: str) -> str:
    if name in REMOVED_FLAGS:
        return f"{name}: not accepted by trtllm-build 1.2 ({REMOVED_FLAGS[name]})"
    known = [*BUILD_FLAGS, *ALIASES]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"{name}: unknown trtllm-build 1.2 flag{hint}"


def _value_problem(spec: FlagSpec, given: str, value: str) -> str | None:
    if spec.kind == "int":
        try:
            int(value)
        except ValueError:
            return f"{given}: expected an integer, got {value!r}"
        return None
    if spec.choices is not None:
        # --kv_cache_type is matched case-insensitively upstream (KVCacheType._missing_).
        candidate = value.lower() if spec.name == "--kv_cache_type" else value
        if candidate not in spec.choices:
            return f"{given}: {value!r} is not one of {', '.join(spec.choices)}"
    return None


def check_flags(argv: list[str]) -> list[str]:
    """Check a ``trtllm-build`` argument list against the 1.2.1 command line.

    ``argv`` is what follows ``trtllm-build`` (no program name).  Returns a list of
    human-readable problems; an empty list means upstream's parser would accept it.
    Stricter than argparse on purpose: abbreviated flags (argparse's prefix matching)
    and repeated flags are reported, so that generated commands stay explicit.
    """
    problems: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token == "-":
            problems.append(f"{token!r}: unexpected positional argument (trtllm-build takes only flags)")
            continue
        given, has_inline, inline = token.partition("=")
        if given in _HELP_FLAGS:
            continue
        name = canonical_flag(given)
        if name is None:
            problems.append(_unknown_flag_problem(given))
            continue
        spec = BUILD_FLAGS[name]
        if name in seen:
            problems.append(f"{given}: given more than once")
        seen.add(name)
        if not spec.takes_value:
            if has_inline:
                problems.append(f"{given}: takes no value, got {inline!r}")
            continue
        values: list[str] = []
        if has_inline:
            values.append(inline)
        else:
            while i < len(argv) and not (argv[i].startswith("--") or argv[i] in _HELP_FLAGS):
                values.append(argv[i])
                i += 1
                if spec.nargs is None:
                    break
        if not values:
            problems.append(f"{given}: needs a value")
            continue
        for value in values:
            problem = _value_problem(spec, given, value)
            if problem:
                problems.append(problem)
    return problems
