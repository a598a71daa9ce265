"""Validate an object against a CustomResourceDefinition's ``openAPIV3Schema`` offline, as the API server does.

A CRD's schema is OpenAPI v3 with Kubernetes' extensions, not plain JSON Schema. :func:`crd_validator` turns one
into a ``jsonschema`` validator with the API server's semantics:

- ``x-kubernetes-int-or-string: true``: an integer or a string (the schema then carries no ``type``);
- ``nullable: true``: null is allowed too;
- an object with ``properties`` and neither ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``
  refuses unknown fields (the API server prunes them, and kubectl's default ``--validate=strict`` reports them
  as errors: kiln reports them);
- ``x-kubernetes-preserve-unknown-fields: true``: unknown fields are kept and not checked;
- ``x-kubernetes-embedded-resource: true``: the object must carry ``apiVersion`` and ``kind``;
- ``x-kubernetes-list-type: map`` with ``x-kubernetes-list-map-keys``: no two items share their keys;
  ``x-kubernetes-list-type: set``: no two items are equal;
- ``x-kubernetes-validations`` (CEL rules) are not evaluated offline: :func:`cel_rules` lists them so a caller can
  check the ones it depends on itself.

``description`` fields are ignored (a data file may drop them to cut size).
"""

from __future__ import annotations

from typing import Any, Iterator

import jsonschema
from jsonschema import ValidationError


def _list_map_keys(validator: Any, keys: list[str], instance: Any, schema: dict) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    seen: dict[tuple, int] = {}
    for i, item in enumerate(instance):
        if not isinstance(item, dict):
            continue
        key = tuple(item.get(k) for k in keys)
        if key in seen:
            yield ValidationError(f"item {i} has the same {', '.join(keys)} {list(key)!r} as item {seen[key]} "
                                  "(x-kubernetes-list-type: map)")
        else:
            seen[key] = i


def _embedded(validator: Any, value: bool, instance: Any, schema: dict) -> Iterator[ValidationError]:
    if value and validator.is_type(instance, "object"):
        for key in ("apiVersion", "kind"):
            if key not in instance:
                yield ValidationError(f"{key!r} is a required property (x-kubernetes-embedded-resource)")


_Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, {
    "x-kubernetes-list-map-keys": _list_map_keys,
    "x-kubernetes-embedded-resource": _embedded,
})


def to_json_schema(node: Any) -> Any:
    """One CRD schema node as JSON Schema (draft 7 plus the two keywords above)."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items()
           if k not in ("description", "x-kubernetes-validations", "nullable", "x-kubernetes-int-or-string",
                        "x-kubernetes-preserve-unknown-fields", "properties", "additionalProperties")}
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    if "additionalProperties" in node:
        extra = node["additionalProperties"]
        out["additionalProperties"] = to_json_schema(extra) if isinstance(extra, dict) else extra
    elif "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # strict field validation
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if node.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    return out


def crd_validator(open_api_v3_schema: dict) -> Any:
    """A ``jsonschema`` validator for objects of the CRD version whose ``openAPIV3Schema`` is given."""
    return _Validator(to_json_schema(open_api_v3_schema))


def cel_rules(node: Any, path: str = "") -> list[tuple[str, str, str]]:
    """Every ``x-kubernetes-validations`` rule in the schema: (where, rule, message); not evaluated offline."""
    found: list[tuple[str, str, str]] = []
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations") or []:
            found.append((path or "(top)", rule.get("rule", ""), rule.get("message", "")))
        for key, child in (node.get("properties") or {}).items():
            found += cel_rules(child, f"{path}.{key}".lstrip("."))
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                found += cel_rules(node[key], f"{path}[]" if key == "items" else f"{path}.*")
    return found
