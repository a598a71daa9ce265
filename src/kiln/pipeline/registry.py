"""The step registry: the pipeline's order and where each step's declaration lives."""

from __future__ import annotations

import importlib

from kiln.steps.base import StepSpec

# step name -> module whose SPEC declares it
STEP_MODULES: dict[str, str] = {
    "resolve": "kiln.steps.resolve",
    "quantize": "kiln.steps.quantize",
    "evaluate": "kiln.steps.evaluate",
    "engine": "kiln.steps.engine",
    "package": "kiln.steps.package",
}
STEP_ORDER: tuple[str, ...] = tuple(STEP_MODULES)


def load_steps() -> dict[str, StepSpec]:
    """Every step that exists; a step whose module is not built yet is absent (the runner says so)."""
    specs: dict[str, StepSpec] = {}
    for name, module in STEP_MODULES.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                continue
            raise
        spec = getattr(mod, "SPEC")
        assert spec.name == name, f"{module}.SPEC is named {spec.name!r}, expected {name!r}"
        specs[name] = spec
    return specs
