"""``kiln plan``: memory, KV-cache and roofline arithmetic for a recipe on a GPU, and its serving speed for a
workload (no GPU needed)."""

from kiln.plan.errors import PlanError
from kiln.plan.model import (
    ModelShape,
    load_model_config,
    parse_model_config,
    shipped_model_config,
    shipped_model_ids,
)
from kiln.plan.planner import Plan, PlanInputs, make_plan, resolve_gpu, valid_tp_sizes
from kiln.plan.recipe import plan_for, plan_gpu, plan_inputs, recipe_model_config
from kiln.plan.render import render_plan
from kiln.plan.result import SpeedPlan, WorkloadPlan
from kiln.plan.speed import SpeedModel, SpeedParams, Workload

__all__ = [
    "ModelShape",
    "Plan",
    "PlanError",
    "PlanInputs",
    "load_model_config",
    "make_plan",
    "parse_model_config",
    "plan_for",
    "plan_gpu",
    "plan_inputs",
    "recipe_model_config",
    "render_plan",
    "resolve_gpu",
    "shipped_model_config",
    "shipped_model_ids",
    "valid_tp_sizes",
    "SpeedModel",
    "SpeedParams",
    "SpeedPlan",
    "Workload",
    "WorkloadPlan",
]
