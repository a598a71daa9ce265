"""Load a recipe: safe YAML with line numbers, `extends` merged key by key, `--set` overrides, validation.

Precedence: `--set` beats the file, the file beats the base it extends, and the base beats the schema's
defaults. Every problem — YAML syntax, unknown keys, wrong types, cross-field rules — is collected and
raised together as one :class:`~kiln.recipe.errors.RecipeError`, each naming file:line and the dotted key.
"""

from __future__ import annotations

import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from kiln.recipe.errors import Origin, Problem, RecipeError
from kiln.recipe.schema import RENAMED_KEYS, Recipe

Path_ = tuple[str, ...]
_MAX_EXTENDS_DEPTH = 16
_MAX_NODES = 100_000  # values in one file once YAML aliases are expanded; a recipe has a few hundred


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe with where each value came from and the warnings found."""

    recipe: Recipe
    path: Optional[Path]
    origins: dict[Path_, Origin] = field(default_factory=dict)
    warnings: tuple[Problem, ...] = ()
    overrides: tuple[str, ...] = ()

    def origin_of(self, key: str) -> Optional[Origin]:
        return _origin_for(self.origins, tuple(key.split(".")))

    def user_set(self, key: str) -> bool:
        """True when the recipe (or a base, or --set) wrote this key, rather than the schema's default."""
        return tuple(key.split(".")) in self.origins


# --------------------------------------------------------------------------------------------- YAML


def _yaml_problem(err: yaml.YAMLError, file: str) -> Problem:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    line = mark.line + 1 if mark is not None else None
    what = getattr(err, "problem", None) or str(err)
    ctx = getattr(err, "context", None)
    msg = f"invalid YAML: {what}" + (f" ({ctx})" if ctx else "")
    hint = ""
    if isinstance(err, yaml.constructor.ConstructorError) and "tag" in str(what):
        hint = "recipes are plain YAML: remove the tag (e.g. !!python/...) and write a plain value"
    return Problem("error", "", msg, Origin(file, line), hint)


def _walk_lines(node: yaml.Node, prefix: Path_, file: str, out: dict[Path_, Origin],
                problems: list[Problem]) -> None:
    """Record the line of every mapping key; report duplicate keys (PyYAML silently keeps the last)."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = str(key_node.value)
        path = prefix + (key,)
        if key in seen:
            problems.append(Problem("error", ".".join(path), "duplicate key",
                                    Origin(file, key_node.start_mark.line + 1),
                                    "keep one of the two entries"))
        seen.add(key)
        out[path] = Origin(file, key_node.start_mark.line + 1)
        _walk_lines(value_node, path, file, out, problems)


def _expanded_size_exceeds(node: Optional[yaml.Node], limit: int) -> bool:
    """Whether the YAML graph has more than `limit` nodes with aliases expanded (as loading expands them).

    Guards everything that walks the loaded data against alias bombs and recursive anchors (`&a [*a]`)."""
    count, stack = 0, [node] if node is not None else []
    while stack:
        n = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                stack.extend((k, v))
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return False


def read_yaml(path: Path) -> tuple[dict, dict[Path_, Origin]]:
    """Read one YAML file safely; return its mapping and the line of each key. Raises RecipeError."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([Problem("error", "", "recipe file not found", Origin(file),
                                   "check the path; `kiln ls` lists shipped recipes")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([Problem("error", "", f"cannot read recipe: {exc}", Origin(file))]) from None
    if not text.strip():
        raise RecipeError([Problem("error", "", "recipe file is empty", Origin(file),
                                   "start from a shipped recipe: kiln new NAME --from configs/tiny-llama.yaml")])
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if _expanded_size_exceeds(node, _MAX_NODES):
            raise RecipeError([Problem("error", "", f"recipe too large: more than {_MAX_NODES} values once YAML "
                                       "aliases are expanded", Origin(file),
                                       "remove recursive or repeatedly nested anchors (&name / *name)")])
        data = yaml.load(text, Loader=yaml.SafeLoader)  # noqa: S506 - SafeLoader
    except yaml.YAMLError as exc:
        raise RecipeError([_yaml_problem(exc, file)]) from None
    except RecipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - PyYAML's constructors fail in many ways on malformed input
        # (huge ints: ValueError; deep nesting: RecursionError; `!!timestamp x`: AttributeError)
        raise RecipeError([Problem("error", "", f"invalid YAML: {exc}", Origin(file))]) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        line = node.start_mark.line + 1 if node is not None else None
        raise RecipeError([Problem("error", "", f"a recipe must be a mapping of keys to values, not {kind}",
                                   Origin(file, line), "write `name: my-recipe` and the sections below it")])
    lines: dict[Path_, Origin] = {}
    problems: list[Problem] = []
    _walk_lines(node, (), file, lines, problems)
    for key in _non_string_keys(data, ()):
        problems.append(Problem("error", ".".join(map(str, key)), "keys must be strings",
                                _origin_for(lines, tuple(map(str, key))) or Origin(file)))
    if problems:
        raise RecipeError(problems)
    return data, lines


def _non_string_keys(data: Any, prefix: tuple) -> Iterable[tuple]:
    if isinstance(data, dict):
        for k, v in data.items():
            if not isinstance(k, str):
                yield prefix + (k,)
            else:
                yield from _non_string_keys(v, prefix + (k,))


# --------------------------------------------------------------------------------------------- merge


def deep_merge(base: dict, over: dict) -> dict:
    """Key-by-key merge: mappings merge recursively, anything else in `over` replaces `base`."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _load_with_extends(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[Path_, Origin]]:
    data, lines = read_yaml(path)
    base_ref = data.get("extends")
    if base_ref is None:
        return data, lines
    origin = lines.get(("extends",), Origin(str(path)))
    if not isinstance(base_ref, str) or not base_ref.strip():
        raise RecipeError([Problem("error", "extends", "must be the path of a base recipe", origin)])
    base_path = Path(os.path.normpath(path.parent / base_ref))
    try:
        base_resolved, base_exists = base_path.resolve(), base_path.is_file()
    except (OSError, ValueError) as exc:
        raise RecipeError([Problem("error", "extends", f"cannot use base recipe {base_ref!r}: {exc}", origin,
                                   "extends is the path of a base recipe, relative to this file")]) from None
    if base_resolved in chain or base_resolved == path.resolve():
        raise RecipeError([Problem("error", "extends", f"circular extends: {base_ref}", origin,
                                   "a recipe cannot extend itself or one of the recipes that extend it")])
    if len(chain) >= _MAX_EXTENDS_DEPTH:
        raise RecipeError([Problem("error", "extends", "extends chain too deep", origin)])
    if not base_exists:
        raise RecipeError([Problem("error", "extends", f"base recipe {base_ref!r} not found "
                                   f"(looked for {base_path})", origin,
                                   "extends is relative to the recipe that names it")])
    base, base_lines = _load_with_extends(base_path, chain + (path.resolve(),))
    base.pop("name", None)  # a name belongs to one recipe; a base's name is never inherited
    base.pop("description", None)
    merged = deep_merge(base, data)
    origins = {**{k: v for k, v in base_lines.items() if k[0] not in ("name", "description")}, **lines}
    return merged, origins


# --------------------------------------------------------------------------------------------- --set


def parse_override(item: str) -> tuple[Path_, Any]:
    """`engine.max_batch_size=64` → (("engine", "max_batch_size"), 64). Values are parsed as YAML scalars."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError([Problem("error", key, f"bad --set {item!r}", Origin("--set"),
                                   "write --set section.key=value, e.g. --set engine.max_batch_size=64")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    except Exception as exc:  # noqa: BLE001 - huge ints, deep nesting, malformed tags (`!!timestamp x`)
        raise RecipeError([Problem("error", key, f"cannot read the value of --set {key}: {exc}",
                                   Origin(f"--set {key}"), "write a plain scalar, e.g. 64, true or fp8")]) from None
    return tuple(key.split(".")), value


def apply_overrides(data: dict, origins: dict[Path_, Origin], overrides: Iterable[str]) -> dict:
    data = _deep_copy(data)
    problems = []
    for item in overrides:
        try:
            path, value = parse_override(item)
        except RecipeError as exc:
            problems.extend(exc.problems)
            continue
        node = data
        origin = Origin(f"--set {'.'.join(path)}")
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
                origins[path[: i + 1]] = origin  # created (or replaced a scalar): errors there are this --set's
            node = nxt
        node[path[-1]] = value
        origins[path] = origin
    if problems:
        raise RecipeError(problems)
    return data


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


# --------------------------------------------------------------------------------------------- validation


def _origin_for(origins: dict[Path_, Origin], path: Path_) -> Optional[Origin]:
    for n in range(len(path), 0, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return None


def _model_at(path: Path_) -> Optional[type[BaseModel]]:
    model: type[BaseModel] = Recipe
    for part in path:
        f = model.model_fields.get(part)
        if f is None:
            return None
        ann = f.annotation
        candidates = [ann] + list(typing.get_args(ann))
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        model = nxt
    return model


def _tuples(data: Any) -> Any:
    """YAML gives lists; the frozen schema stores sequences as tuples."""
    if isinstance(data, dict):
        return {k: _tuples(v) for k, v in data.items()}
    if isinstance(data, list):
        return tuple(_tuples(v) for v in data)
    return data


def _schema_problem(err: dict, origins: dict[Path_, Origin], file: str) -> Problem:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    etype = err["type"]
    origin = _origin_for(origins, loc) or Origin(file)
    if etype == "extra_forbidden":
        parent = _model_at(loc[:-1])
        hint = ""
        if key in RENAMED_KEYS:
            hint = f"renamed: write `{RENAMED_KEYS[key]}` instead"
        elif parent is not None:
            close = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1, cutoff=0.6)
            if close:
                hint = f"did you mean `{close[0]}`?"
            else:
                hint = "known keys here: " + ", ".join(parent.model_fields)
        return Problem("error", key, "unknown key", origin, hint)
    if etype == "missing":
        return Problem("error", key, "required key is missing", origin, f"add `{loc[-1]}:`")
    msg = err["msg"]
    if etype in ("literal_error", "enum"):
        got = err.get("input")
        msg = f"{got!r} is not allowed; {msg[0].lower()}{msg[1:]}"
        hint = ""
        allowed = _literal_choices(loc)
        if allowed and isinstance(got, str):
            close = difflib.get_close_matches(got, allowed, n=1, cutoff=0.5)
            if close:
                hint = f"did you mean `{close[0]}`?"
        return Problem("error", key, msg, origin, hint)
    if etype.endswith("_type") or etype.endswith("_parsing"):
        msg = f"{msg} (got {err.get('input')!r})"
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return Problem("error", key, msg, origin)


def _literal_choices(loc: Path_) -> list[str]:
    parent = _model_at(loc[:-1])
    if parent is None or loc[-1] not in parent.model_fields:
        return []
    ann = parent.model_fields[loc[-1]].annotation
    out: list[str] = []
    stack = [ann]
    while stack:
        a = stack.pop()
        if typing.get_origin(a) is typing.Literal:
            out.extend(str(x) for x in typing.get_args(a))
        else:
            stack.extend(typing.get_args(a))
    return out


def _drop(data: dict, loc: tuple) -> None:
    node: Any = data
    for part in loc[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(loc[-1], None)


def validate_data(data: dict, origins: dict[Path_, Origin], file: str) -> tuple[Optional[Recipe], list[Problem]]:
    """Validate into Recipe. On schema errors, also try a best-effort recipe (bad keys dropped to defaults)
    so cross-field rules can still report their problems in the same run."""
    try:
        return Recipe.model_validate(_tuples(data), strict=True), []
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    problems = [_schema_problem(e, origins, file) for e in errors]
    salvage = _deep_copy(data)
    for _ in range(4):
        for e in errors:
            if e["type"] == "missing":
                if tuple(e["loc"]) == ("name",):
                    salvage["name"] = "unnamed"
                continue
            loc = tuple(e["loc"])
            # drop the offending key (or the whole non-mapping section) so the default is used
            while loc and isinstance(loc[-1], int):
                loc = loc[:-1]
            if loc:
                _drop(salvage, loc)
        try:
            return Recipe.model_validate(_tuples(salvage), strict=True), problems
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
    return None, problems


def load_recipe(path: str | Path, overrides: Iterable[str] = (), strict: bool = False,
                check_rules: bool = True) -> LoadedRecipe:
    """Load, merge, override and validate a recipe. Raises RecipeError with every problem found.

    With `strict`, warnings are errors too.
    """
    from kiln.recipe.rules import check_rules as run_rules  # rules import the GPU table; keep import light

    path = Path(path)
    overrides = tuple(overrides)
    data, origins = _load_with_extends(path, ())
    data = apply_overrides(data, origins, overrides)
    recipe, problems = validate_data(data, origins, str(path))
    rule_problems: list[Problem] = []
    if recipe is not None and check_rules:
        bad_keys = {p.key for p in problems}
        for p in run_rules(recipe):
            if p.key in bad_keys:
                continue  # already reported by the schema; the salvaged default would mislead
            origin = p.origin or _origin_for(origins, tuple(p.key.split("."))) or Origin(str(path))
            rule_problems.append(Problem(p.severity, p.key, p.message, origin, p.hint))
    problems += rule_problems
    errors = [p for p in problems if p.severity == "error" or strict]
    if errors:
        raise RecipeError([p if p.severity == "error" else Problem("error", p.key, p.message + " (--strict)",
                                                                   p.origin, p.hint) for p in problems])
    assert recipe is not None
    return LoadedRecipe(recipe, path, origins, tuple(p for p in problems if p.severity == "warning"), overrides)


def recipe_from_dict(data: dict, name_hint: str = "<dict>") -> Recipe:
    """Validate an in-memory mapping (tests, sweeps). Raises RecipeError."""
    recipe, problems = validate_data(data, {}, name_hint)
    if problems or recipe is None:
        raise RecipeError(problems)
    return recipe
