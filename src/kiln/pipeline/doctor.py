"""``kiln doctor``: the first run on a GPU host. The built-in tiny model goes through the real engine runtime for both
GPU targets — tensorrt (TensorRT-LLM's quantizer, the quality gate, trtllm-build, a Triton repository) and pytorch
(ModelOpt's unified checkpoint, an llmapi repository) — each repository is served in the serving container, and its
greedy output is compared with kiln's CPU reference runtime on the same checkpoint (the unquantized weights with the
quantizers the runtime calibrated). One verdict per step, with the log of anything that failed.

Without what a GPU run needs (a GPU, a driver the image's CUDA runs on, a container engine, the image) it says what
it would run and why it cannot, without starting anything, and fails.

The CPU reference runtime is kiln's test and development vehicle: here it is the yardstick the GPU output is held
to, never a stand-in for it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kiln.recipe.catalog import configs_dir
from kiln.recipe.loader import LoadedRecipe, load_recipe

TARGETS = ("tensorrt", "pytorch")
PROMPT = "The quick brown fox"
MAX_TOKENS = 16
RECIPE = "tiny-llama.yaml"


@dataclass
class Verdict:
    """One step's outcome: ``pass``, ``fail``, ``skip`` (not run: an earlier step failed) or ``would run``."""

    target: str
    step: str
    verdict: str
    detail: str = ""
    log: Optional[Path] = None

    def line(self) -> str:
        tail = f" (log: {self.log})" if self.log is not None and self.verdict == "fail" else ""
        return f"{self.verdict.upper():9} {self.target:9} {self.step:9} {self.detail}{tail}"


@dataclass
class DoctorReport:
    verdicts: list[Verdict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(v.verdict == "pass" for v in self.verdicts)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems,
                "verdicts": [{**v.__dict__, "log": str(v.log) if v.log else None} for v in self.verdicts]}


def doctor_recipe(target: str, gpu: Optional[str] = None) -> LoadedRecipe:
    """The built-in tiny model's recipe for ``target``, on this machine's GPU (``hardware.gpu``) when known."""
    overrides = [f"target={target}", f"name=doctor-{target}"]
    if target == "pytorch":
        overrides.append("quantization.runtime=engine")
    if gpu:
        overrides.append(f"hardware.gpu={gpu}")
    return load_recipe(configs_dir() / RECIPE, overrides)


def _steps(loaded: LoadedRecipe) -> list[str]:
    """The pipeline steps the doctor checks for the recipe's target (resolve is kiln's own bookkeeping)."""
    return ["quantize", "evaluate", "engine", "package"] if loaded.recipe.target == "tensorrt" \
        else ["quantize", "evaluate", "package"]


def plan(build_root: Path, targets: tuple[str, ...] = TARGETS) -> list[Verdict]:
    """What the doctor runs, step by step, for ``targets`` (starts nothing)."""
    from kiln.runtime.engine_runtime import engine_runtime_for
    from kiln.serve.session import serving_engine

    rows = []
    for target in targets:
        loaded = doctor_recipe(target)
        rt = engine_runtime_for(loaded.recipe, build_root)
        fmt = loaded.recipe.quantization.format
        what = {
            "quantize": (f"{fmt} with TensorRT-LLM's quantize_and_export" if target == "tensorrt"
                         else f"{fmt} with the image's ModelOpt (unified checkpoint)") + f" in {rt.describe()}",
            "evaluate": f"the quality gate (perplexity, KL) in {rt.describe()}",
            "engine": f"trtllm-build in {rt.describe()}",
            "package": "the Triton repository (" + ("inflight_batcher_llm" if target == "tensorrt" else "llmapi") + ")",
        }
        rows.append(Verdict(target, "probe", "would run", f"versions and GPUs as {rt.describe()} reports them"))
        rows += [Verdict(target, s, "would run", what.get(s, s)) for s in _steps(loaded)]
        serve_engine, _ = serving_engine(getattr(rt, "engine", None), getattr(rt, "exe", None))
        rows.append(Verdict(target, "serve", "would run", f"the repository in its serving container ({serve_engine} "
                            "run … tritonserver), one greedy request of "
                            f"{MAX_TOKENS} tokens for {PROMPT!r}"))
        rows.append(Verdict(target, "compare", "would run", "that output against kiln's CPU reference runtime on "
                            "the same checkpoint and quantizers"))
    return rows


def host_problems(build_root: Path, targets: tuple[str, ...] = TARGETS) -> list[str]:
    """Why a GPU run cannot start here: the GPU, the driver, the container engine and the image (preflight's own
    checks, for both targets' recipes; nothing is started)."""
    from kiln.pipeline.preflight import _driver_problems, _gpu_problems
    from kiln.recipe.gpus import detected_gpu_names
    from kiln.runtime.engine_runtime import engine_runtime_for

    problems: list[str] = []
    names = detected_gpu_names()
    if not names:
        problems.append("no GPU: nvidia-smi is absent or lists no device, and every doctor step runs on a CUDA GPU "
                        "in the engine runtime")
    for target in targets:
        loaded = doctor_recipe(target)
        if names:
            problems += [p for p in _gpu_problems(loaded.recipe, ["quantize"]) if p not in problems]
            problems += [p for p in _driver_problems(loaded.recipe) if p not in problems]
        problems += [p for p in engine_runtime_for(loaded.recipe, build_root).problems() if p not in problems]
    return problems


# ------------------------------------------------------------------------------------------ the GPU run


def _log_of(message: str, out_dir: Optional[Path]) -> Optional[Path]:
    """The log a failed step's message names (the engine runtime keeps failed jobs' logs), else its output's."""
    import re

    for found in re.findall(r"(/\S+\.log)\b", message or ""):
        if Path(found).is_file():
            return Path(found)
    logs = sorted((out_dir / "logs").glob("*.log")) if out_dir is not None and (out_dir / "logs").is_dir() else []
    return logs[-1] if logs else out_dir


def reference_greedy(quantize_dir: Path, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> str:
    """Greedy text from the CPU reference path on the quantize step's output: the unquantized checkpoint with the
    runtime's quantizers restored (ModelOpt fake-quant), Hugging Face ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kiln.runtime.workers.worker_io import restore_quantizer_state

    ckpt = quantize_dir / "checkpoint"
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model = restore_quantizer_state(model, ckpt / "modelopt_state.pth")
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def serve_greedy(repo: Path, log: Path, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS,
                 timeout_s: float = 600.0, engine: str = "docker", exe: Optional[str] = None) -> str:
    """Serve ``repo`` in its serving container (kiln serve --docker's command, run by the container engine the
    build's jobs ran in, named so it can be stopped), send one greedy request, stop it."""
    import urllib.request

    from kiln.serve.client import generate_http
    from kiln.serve.server import ServerConfig, free_port
    from kiln.serve.session import docker_command

    info = json.loads((repo / "kiln.json").read_text())
    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    cmd = docker_command(repo, info, cfg, engine=engine, exe=exe)
    name = f"kiln-doctor-{uuid.uuid4().hex[:8]}"
    cmd = [cmd[0], cmd[1], "--name", name, *cmd[2:]]
    log.parent.mkdir(parents=True, exist_ok=True)
    url = f"http://{cfg.host}:{cfg.http_port}"
    with open(log, "w", encoding="utf-8") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the serving container exited ({proc.returncode}) before it was ready")
                try:
                    with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")
                time.sleep(2)
            model = "ensemble" if info.get("layout") != "llmapi" else (info.get("tensorrt_llm_models") or ["tensorrt_llm"])[0]
            return generate_http(url, prompt, max_tokens, model=model, temperature=0.0, top_k=1)
        finally:
            subprocess.run([cmd[0], "stop", name], capture_output=True, timeout=120, check=False)
            proc.wait(timeout=120)


def run(build_root: Path, repo_root: Path, progress: Callable[[str], None] = lambda s: None,
        targets: tuple[str, ...] = TARGETS) -> DoctorReport:
    """The GPU run for ``targets`` (default both); never raises for a failed step (its verdict says so)."""
    from kiln.pipeline.runner import Layout, Status
    from kiln.pipeline.runner import run as run_pipeline
    from kiln.recipe.gpus import detect_gpus
    from kiln.runtime.engine_runtime import engine_runtime_for, read_versions
    from kiln.serve.session import serving_engine

    report = DoctorReport()
    report.problems = host_problems(build_root, targets)
    if report.problems:
        report.verdicts = plan(build_root, targets)
        return report
    found = detect_gpus()
    gpu = found[0] if found else None
    root = build_root / "doctor"
    for target in targets:
        loaded = doctor_recipe(target, gpu)
        rt = engine_runtime_for(loaded.recipe, root)
        probe_log = root / loaded.recipe.name / "logs" / "probe.log"
        try:
            got = read_versions(rt, probe_log)
            report.verdicts.append(Verdict(target, "probe", "pass", f"TensorRT-LLM {got.tensorrt_llm}, TensorRT "
                                           f"{got.tensorrt}, ModelOpt {got.modelopt}, GPUs {', '.join(got.gpus)}"))
        except Exception as exc:  # noqa: BLE001 - the verdict carries it
            report.verdicts.append(Verdict(target, "probe", "fail", str(exc).splitlines()[0], probe_log))
            continue
        progress(f"{target}: building the tiny model in {rt.describe()}")
        summary = run_pipeline(loaded, Layout(root, repo_root / "doctor"), progress=False)
        outcomes = {o.name: o for o in summary.outcomes}
        failed = False
        for step in _steps(loaded):
            o = outcomes.get(step)
            if o is None or failed:
                report.verdicts.append(Verdict(target, step, "skip", "an earlier step failed"))
                continue
            if o.status == Status.NOT_RUN:
                failed = True
                report.verdicts.append(Verdict(target, step, "skip", o.message or "not run"))
                continue
            if o.status == Status.FAILED or (summary.failure is not None and o.message):
                failed = True
                message = o.message or str(summary.failure)
                report.verdicts.append(Verdict(target, step, "fail", message.splitlines()[0].split("; last lines")[0],
                                               _log_of(message, o.out_dir)))
            else:
                report.verdicts.append(Verdict(target, step, "pass", f"{o.status} in {o.seconds:.0f} s"))
        if failed or summary.failure is not None:
            report.verdicts += [Verdict(target, s, "skip", "the build failed") for s in ("serve", "compare")]
            continue
        repo = repo_root / "doctor" / loaded.recipe.name
        serve_log = root / loaded.recipe.name / "logs" / "serve.log"
        try:
            engine, exe = serving_engine(getattr(rt, "engine", None), getattr(rt, "exe", None))
            served = serve_greedy(repo, serve_log, engine=engine, exe=exe)
            report.verdicts.append(Verdict(target, "serve", "pass", f"{served!r}"))
        except Exception as exc:  # noqa: BLE001
            report.verdicts.append(Verdict(target, "serve", "fail", str(exc).splitlines()[0], serve_log))
            report.verdicts.append(Verdict(target, "compare", "skip", "nothing served"))
            continue
        reference = reference_greedy(root / loaded.recipe.name / "quantize")
        same = served.strip() == reference.strip()
        report.verdicts.append(Verdict(target, "compare", "pass" if same else "fail",
                                       f"served {served!r}, CPU reference {reference!r}", None if same else serve_log))
    return report
