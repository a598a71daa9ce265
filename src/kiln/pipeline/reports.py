"""Reports CI understands: the run summary and the schedule as JSON (stable, versioned, with a published JSON
Schema each), and JUnit XML (a test case per step and per quality-gate criterion, the figures in the message).

JSON: ``kiln build --json`` prints :func:`summary_dict`, ``kiln build --dry-run --json`` prints
:func:`schedule_dict`. Each carries ``schema_version`` (:data:`SCHEMA_VERSION`) and validates against
``kiln/pipeline/data/build-summary.schema.json`` / ``build-schedule.schema.json``. Fields are only ever added
within a version; a field removed or changing meaning bumps it.
"""

from __future__ import annotations

import json
import socket
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import kiln
from kiln.steps.base import Gate

if TYPE_CHECKING:
    from kiln.pipeline.runner import RunSummary, ScheduledStep
    from kiln.recipe.loader import LoadedRecipe

SCHEMA_VERSION = 1
SUMMARY_SCHEMA = "build-summary.schema.json"
SCHEDULE_SCHEMA = "build-schedule.schema.json"


def json_schema(name: str) -> dict[str, Any]:
    """One of the published JSON Schemas (:data:`SUMMARY_SCHEMA`, :data:`SCHEDULE_SCHEMA`)."""
    return json.loads(resources.files("kiln.pipeline").joinpath("data", name).read_text())


def _gate_dict(g: Gate) -> dict[str, Any]:
    return {"name": g.name, "key": g.key, "status": _gate_status(g), "message": g.message}


def _gate_status(g: Gate) -> str:
    return "off" if g.passed is None else "passed" if g.passed else "failed"


def summary_dict(summary: "RunSummary") -> dict[str, Any]:
    failure = summary.failure
    return {
        "schema_version": SCHEMA_VERSION,
        "kiln_version": kiln.__version__,
        "recipe": summary.recipe,
        "ok": failure is None,
        "exit_code": failure.exit_code if failure is not None else 0,
        "failure": str(failure) if failure is not None else None,
        "seconds": round(summary.seconds, 3),
        "swept": [str(p) for p in summary.swept],
        "cache": ({"remote": summary.cache, "warnings": list(summary.cache_warnings)}
                  if summary.cache is not None else None),
        "steps": [{
            "name": o.name,
            "status": o.status.value,
            "seconds": round(o.seconds, 3),
            "fingerprint": o.fingerprint or None,
            "output": str(o.out_dir) if o.out_dir else None,
            "result": o.result.model_dump(mode="json") if o.result is not None else {},
            "reused_from": str(o.reused_from) if o.reused_from else None,
            "pulled_from": o.pulled_from,
            "pushed_to": o.pushed_to,
            "message": o.message,
            "gates": [_gate_dict(g) for g in o.gates],
        } for o in summary.outcomes],
    }


def summary_json(summary: "RunSummary") -> str:
    return json.dumps(summary_dict(summary), indent=2, default=str)


def schedule_dict(scheduled: list["ScheduledStep"], loaded: "LoadedRecipe",
                  lookup: Optional[Callable[["ScheduledStep"], Optional[str]]] = None) -> dict[str, Any]:
    """The schedule as data: each step's action, reasons and fingerprint (what any CI cache can key on), and
    with a remote cache whether it holds the step's output."""
    return {
        "schema_version": SCHEMA_VERSION,
        "kiln_version": kiln.__version__,
        "recipe": loaded.recipe.name,
        "target": loaded.recipe.target,
        "cache": loaded.recipe.cache.remote,
        "steps": [{
            "name": p.spec.name,
            "action": p.action.value,
            "fingerprint": p.fingerprint,
            "output": str(p.out_dir),
            "reasons": list(p.reasons),
            "remote": lookup(p) if lookup is not None and p.action.value == "run" else None,
            "details": list(p.spec.describe(loaded)) if p.spec.describe is not None else [],
        } for p in scheduled],
    }


def junit_xml(summary: "RunSummary") -> str:
    """JUnit XML: one test case per step (failed → <failure>, not run → <skipped>) and one per quality-gate
    criterion (failed → <failure> whose message holds the figures, off → <skipped>). Names are stable across
    runs (CI tracks cases by name); every case's figures are also in its system-out."""
    suite = ET.Element("testsuite", name=f"kiln build {summary.recipe}",
                       timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       hostname=socket.gethostname(), time=f"{summary.seconds:.3f}")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="kiln_version", value=kiln.__version__)
    if summary.cache:
        ET.SubElement(props, "property", name="cache", value=summary.cache)
    counts = {"tests": 0, "failures": 0, "skipped": 0}

    def case(classname: str, name: str, seconds: float, out: str, failure: Optional[str] = None,
             skipped: Optional[str] = None) -> None:
        el = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.3f}")
        counts["tests"] += 1
        if failure is not None:
            counts["failures"] += 1
            ET.SubElement(el, "failure", message=failure, type="kiln").text = failure
        elif skipped is not None:
            counts["skipped"] += 1
            ET.SubElement(el, "skipped", message=skipped)
        if out:
            ET.SubElement(el, "system-out").text = out

    steps_class = f"kiln.{summary.recipe}.steps"
    for o in summary.outcomes:
        figures = o.result.headline() if o.result is not None else ""
        lines = [f"status: {o.status.value}", f"figures: {figures}" if figures else "",
                 f"fingerprint: {o.fingerprint}" if o.fingerprint else "", f"output: {o.out_dir}" if o.out_dir else "",
                 f"pulled from: {o.pulled_from}" if o.pulled_from else "",
                 f"pushed to: {o.pushed_to}" if o.pushed_to else "", o.message]
        out = "\n".join(line for line in lines if line)
        gate_failed = any(g.passed is False for g in o.gates)
        if o.status.value == "failed":
            case(steps_class, o.name, o.seconds, out, failure=o.message or "failed")
        elif o.status.value == "not run":
            case(steps_class, o.name, 0.0, out, skipped=o.message or "not run: an earlier step failed")
        elif summary.failure is not None and o.message == str(summary.failure) and not gate_failed:
            case(steps_class, o.name, o.seconds, out, failure=o.message)  # e.g. a push under --cache-required
        else:
            case(steps_class, o.name, o.seconds, out)
        for g in o.gates:
            status = _gate_status(g)
            case(f"kiln.{summary.recipe}.quality_gate", f"{g.name} ({g.key})", 0.0, f"{status}: {g.message}",
                 failure=g.message if status == "failed" else None, skipped=g.message if status == "off" else None)
    for key, value in counts.items():
        suite.set(key, str(value))
    suite.set("errors", "0")
    root = ET.Element("testsuites", name="kiln", tests=str(counts["tests"]), failures=str(counts["failures"]),
                      skipped=str(counts["skipped"]), errors="0", time=f"{summary.seconds:.3f}")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(summary: "RunSummary", path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(junit_xml(summary), encoding="utf-8")
    tmp.replace(path)
