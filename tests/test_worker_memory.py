"""Big models in the engine-runtime workers (issue 20, defects 4 and 5): one model on the GPUs at a time, spread over
the recipe's GPUs with the planner's per-GPU budget, and quantizer state without a second copy of the weights.

The workers run here in-process on the CPU with kiln's own ModelOpt and the default build's tiny checkpoint (the
image-environment versions are imgenv's fixture); the GPU spreading is checked up to the boundary: the arguments
``from_pretrained`` gets, with ``torch.cuda.device_count`` and ``from_pretrained`` replaced by STAND-INS.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import weakref
from pathlib import Path

import pytest

from kiln.plan import plan_for
from kiln.plan.workers import recipe_worker_memory, worker_memory
from kiln.recipe.loader import load_recipe
from kiln.runtime.engine_runtime import workers_dir
from tests.conftest import recipe_id, shipped_recipes

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch):
    """The worker scripts as the runtime imports them (siblings on sys.path), loaded from their files."""
    monkeypatch.syspath_prepend(str(workers_dir()))
    for name in ("worker_io", "kiln_worker_evaluate"):
        sys.modules.pop(name, None)
    import worker_io

    spec = importlib.util.spec_from_file_location("kiln_worker_evaluate", workers_dir() / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    yield worker_io, evaluate
    sys.modules.pop("worker_io", None)


def _quantize_dir(default_build) -> Path:
    loaded, layout, _ = default_build
    return layout.build_dir(loaded.recipe.name) / "quantize"


def test_evaluate_holds_one_model_at_a_time_and_scores_as_before(default_build, workers, tmp_path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    worker_io, evaluate = workers
    q = _quantize_dir(default_build)
    seqs = [[1, 5, 9, 14, 22, 31, 7, 2], [1, 40, 41, 42, 43], [1, 3, 3, 3, 8, 13, 21, 34, 55, 89]]
    (tmp_path / "sequences.json").write_text(json.dumps(seqs))
    job = {"model_dir": str(q / "checkpoint"), "modelopt_state": str(q / "checkpoint" / "modelopt_state.pth"),
           "restore_check": str(q / "restore_check.safetensors"), "sequences": str(tmp_path / "sequences.json"),
           "result": str(tmp_path / "result.json"), "dtype": "float32", "batch_size": 2, "pad_id": 0,
           "scratch_dir": str(tmp_path / "scratch")}
    (tmp_path / "job.json").write_text(json.dumps(job))

    real, live, peak = worker_io.load_model, [0], [0]

    def counting(job, device):  # every model a worker loads, alive until garbage
        model = real(job, device)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(model, lambda: live.__setitem__(0, live[0] - 1))
        return model

    monkeypatch.setattr(worker_io, "load_model", counting)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--job", str(tmp_path / "job.json")])
    evaluate.main()
    got = json.loads((tmp_path / "result.json").read_text())
    assert peak[0] == 1, f"{peak[0]} models were on the device at once"
    assert not (tmp_path / "scratch").exists() and got["base_logprob_bytes"] > 0  # the scratch is cleaned up

    # the same figures as both models' logits side by side (nll_and_kl, kiln's host evaluation), up to fp16
    import torch

    base = real(job, "cpu")
    quant = worker_io.restore_quantizer_state(real(job, "cpu"), job["modelopt_state"])
    want = [0.0, 0.0, 0.0, 0]
    with torch.no_grad():
        for ids, mask in evaluate.batches(seqs, 2, 0):
            for i, v in enumerate(evaluate.nll_and_kl(base(input_ids=ids, attention_mask=mask).logits,
                                                      quant(input_ids=ids, attention_mask=mask).logits, ids, mask)):
                want[i] += v
    assert got["tokens"] == want[3] == sum(len(s) - 1 for s in seqs)
    assert got["nll_base"] == pytest.approx(want[0], rel=1e-6) and got["nll_quant"] == pytest.approx(want[1], rel=1e-6)
    assert got["kl"] == pytest.approx(want[2], rel=2e-2, abs=1e-4) and want[2] > 0


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG"])
def test_quantizer_state_holds_no_copy_of_unchanged_weights(default_build, workers, tmp_path, preset) -> None:
    """FP8 calibration changes no weight: the state is ModelOpt's plus the quantizers' tensors, a fraction of the
    weights (mto.save wrote them all). SmoothQuant folds scales into the linear weights: those are kept, the rest
    (embeddings, norms) not. Either way the restored model reproduces the calibrated one exactly."""
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq
    import torch

    worker_io, _ = workers
    q = _quantize_dir(default_build)
    job = {"model_dir": str(q / "checkpoint"), "dtype": "float32"}
    model = worker_io.load_model(job, "cpu")
    ids = torch.tensor([[1, 5, 9, 14, 22, 31, 7, 2, 40, 41]])
    before = worker_io.weight_fingerprints(model)
    model = mtq.quantize(model, getattr(mtq, preset), forward_loop=lambda m: m(input_ids=ids))
    held = worker_io.save_quantizer_state(model, tmp_path / "state.pth", before)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    linear = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in type(m).__name__.lower())
    state = (tmp_path / "state.pth").stat().st_size
    if preset == "FP8_DEFAULT_CFG":
        mto.save(model, tmp_path / "full.pth")
        assert (tmp_path / "full.pth").stat().st_size > weights  # what mto.save writes: every weight again
        assert held["unchanged_weights"] == len(list(model.named_parameters(remove_duplicate=False)))
        assert state < 0.1 * weights, (state, weights)
    else:
        assert 0 < held["unchanged_weights"] and state < 0.6 * weights and held["bytes"] <= linear + 0.1 * weights
    with torch.no_grad():
        want = model(input_ids=ids).logits
        restored = worker_io.restore_quantizer_state(worker_io.load_model(job, "cpu"), tmp_path / "state.pth")
        assert torch.equal(restored(input_ids=ids).logits, want)


def test_workers_spread_the_model_over_the_recipes_gpus(workers, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the model loads with device_map="auto" and the planner's per-GPU budget for the GPUs the process
    sees, and a model that would spill onto the CPU is refused (STAND-INS: two CUDA devices, from_pretrained)."""
    import torch
    import transformers

    worker_io, _ = workers
    calls = []

    class Loaded:
        hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": 1}

        def eval(self):
            return self

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return Loaded()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    placement = {"gpus": 4, "max_memory": {"0": 70 * GIB, "1": 70 * GIB, "2": 70 * GIB, "3": 68 * GIB},
                 "model_bytes": 141 * 10**9}
    worker_io.load_model({"model_dir": "/m", "dtype": "bfloat16", "placement": placement}, "cuda")
    assert calls[-1] == {"dtype": torch.bfloat16, "device_map": "auto", "max_memory": {0: 70 * GIB, 1: 70 * GIB}}
    Loaded.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": "cpu"}
    with pytest.raises(SystemExit, match="does not fit the GPUs' budget"):
        worker_io.load_model({"model_dir": "/m", "dtype": "bfloat16", "placement": placement}, "cuda")


@pytest.mark.parametrize("path", shipped_recipes(), ids=recipe_id)
def test_every_shipped_recipes_workers_fit_its_gpus(path: Path) -> None:
    loaded = load_recipe(path)
    if loaded.recipe.hardware.gpu is None:  # the CPU recipes: plan them on an H100
        loaded = load_recipe(path, ["hardware.gpu=H100-SXM"])
    plan = plan_for(loaded)
    workers = recipe_worker_memory(loaded, plan)
    assert workers.fits, workers.verdict()
    budget = workers.max_memory()
    assert len(budget) == workers.gpus and sum(budget.values()) >= workers.model_bytes


def test_the_plan_refuses_a_70b_model_on_one_gpu_and_the_job_carries_the_budget(kiln) -> None:
    loaded = load_recipe(REPO_ROOT / "configs" / "llama-3.1-70b" / "fp8-tp4.yaml")
    plan = plan_for(loaded)
    assert not worker_memory(plan, eval_samples=1, eval_seq_len=1024, calib_batch=1, calib_seq_len=512, gpus=1).fits
    four = recipe_worker_memory(loaded, plan)
    assert four.gpus == 4 and four.model_bytes > 130 * GIB and four.fits  # ~141 GB bf16: one copy, four GPUs
    from kiln.steps.runtime_jobs import evaluate_job_file, worker_placement

    job = evaluate_job_file({"quantize": "/q", "job": "/j", "out": "/o"}, "bfloat16", 1, 0, worker_placement(loaded))
    assert job["placement"]["max_memory"] == four.max_memory() and job["scratch_dir"] == "/o/base_logprobs"
    result = kiln("plan", str(REPO_ROOT / "configs" / "llama-3.1-70b" / "fp8-tp4.yaml"))
    assert result.exit_code == 0 and "Engine-runtime workers (quantize, export, evaluate): fits:" in result.output
