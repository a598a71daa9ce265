"""The step registry: the pipeline's steps, in order, each imported directly with its declaration."""

from __future__ import annotations

from kiln.steps import engine, evaluate, package, quantize, resolve, tasks
from kiln.steps.base import StepSpec

#: Every step in pipeline order. Importing the step modules is cheap: heavy libraries load inside the steps.
STEPS: tuple[StepSpec, ...] = (resolve.SPEC, quantize.SPEC, evaluate.SPEC, engine.SPEC, package.SPEC, tasks.SPEC)
STEP_ORDER: tuple[str, ...] = tuple(spec.name for spec in STEPS)


def load_steps() -> dict[str, StepSpec]:
    """The steps by name, in pipeline order."""
    return {spec.name: spec for spec in STEPS}
