"""The planner's user-facing error."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad planner input: an unknown GPU or format, a model config missing fields, an impossible split.

    The message always says what is known or allowed (GPU names, required config fields, valid tp sizes).
    """
