"""``engine.gather_context_logits``: the recipe key (default off, fingerprinted), the trtllm-build flag, the engine
config and kiln.json that record it, and the OpenAI server's prompt scoring on a TensorRT engine: refused naming
the key when the engine lacks the logits, reduced inside the server from upstream's ``context_logits`` when it has
them. No GPU here: the Triton side is a scripted gRPC stream answering as upstream's tensorrt_llm model does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.recipe.loader import load_recipe
from kiln.serve.openai.app import ModelInfo
from kiln.serve.openai.backend import GATHER_KEY, Contract, TritonBackend, score_from_logits
from kiln.serve.openai.protocol import APIError
from kiln.steps.trtllm_args import expected_engine_config, trtllm_build_args, verify_engine_config
from kiln.steps.trtllm_flags import check_flags
from kiln.triton.repository import standin_engine_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FP8 = CONFIGS / "llama-3.1-8b" / "fp8.yaml"
ON = ("engine.gather_context_logits=true",)


def test_the_key_is_off_by_default_fingerprinted_and_passed_to_trtllm_build(tmp_path) -> None:
    from kiln.pipeline.runner import Layout, schedule

    off, on = load_recipe(FP8), load_recipe(FP8, ON)
    assert off.recipe.engine.gather_context_logits is False and on.recipe.engine.gather_context_logits is True
    fps = [{p.spec.name: p.fingerprint for p in schedule(x, Layout(tmp_path))} for x in (off, on)]
    assert fps[0]["engine"] != fps[1]["engine"], "it changes the engine"
    assert fps[0]["quantize"] == fps[1]["quantize"], "not the checkpoint"
    args_off, args_on = (trtllm_build_args(x.recipe, "ckpt", "out") for x in (off, on))
    assert "--gather_context_logits" not in args_off
    assert args_on == args_off + ["--gather_context_logits"]
    assert check_flags(args_on) == [], "upstream's flag, as 1.2.1's trtllm-build spells it"
    # the engine's config.json says what it was built with; a mismatch either way is caught
    for loaded in (off, on):
        want = loaded.recipe.engine.gather_context_logits
        cfg = standin_engine_config(loaded.recipe, 8192, version="1.2.1")
        assert expected_engine_config(loaded.recipe, 8192)["build_config.gather_context_logits"] is want
        assert cfg["build_config"]["gather_context_logits"] is want
        assert verify_engine_config(loaded.recipe, cfg, 8192) == []
        cfg["build_config"]["gather_context_logits"] = not want
        assert [p for p in verify_engine_config(loaded.recipe, cfg, 8192) if "gather_context_logits" in p]


def test_a_bad_value_is_refused_naming_the_key(tmp_path) -> None:
    from kiln.util.errors import InputError

    with pytest.raises(InputError) as info:
        load_recipe(FP8, ("engine.gather_context_logits=sometimes",))
    assert "engine.gather_context_logits" in str(info.value)


def _repo(tmp_path: Path, kiln_json: dict | None, engine_cfg: dict | None) -> Path:
    repo = tmp_path / "repo"
    (repo / "tensorrt_llm" / "1" / "engine").mkdir(parents=True)
    if kiln_json is not None:
        (repo / "kiln.json").write_text(json.dumps(kiln_json))
    if engine_cfg is not None:
        (repo / "tensorrt_llm" / "1" / "engine" / "config.json").write_text(json.dumps(engine_cfg))
    return repo


def test_the_server_reads_it_from_kiln_json_or_the_engine_config(tmp_path) -> None:
    recipe = load_recipe(FP8, ON).recipe
    on_cfg = standin_engine_config(recipe, 8192, version="1.2.1")
    assert ModelInfo.from_repository(_repo(tmp_path / "a", {"engine": {"gather_context_logits": True}}, None),
                                     "ensemble").context_logits is True
    assert ModelInfo.from_repository(_repo(tmp_path / "b", {"engine": {"gather_context_logits": False}}, on_cfg),
                                     "ensemble").context_logits is False, "kiln.json wins"
    assert ModelInfo.from_repository(_repo(tmp_path / "c", {"engine": {}}, on_cfg), "ensemble").context_logits
    older = {"build_config": {"max_batch_size": 8}}  # an engine config without the key: built without them
    assert ModelInfo.from_repository(_repo(tmp_path / "d", {"engine": {}}, older), "ensemble").context_logits is False
    assert ModelInfo.from_repository(None, "ensemble").context_logits is None


class ScriptedCall:
    """One ModelStreamInfer call answering as upstream's tensorrt_llm model does with return_context_logits: one
    final response with ``context_logits`` FP32 [1, n, vocab] (raw contents)."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits, self.sent = logits, []

    async def write(self, msg: Any) -> None:
        self.sent.append(msg)

    async def read(self) -> Any:
        from tritonclient.grpc import service_pb2

        item = service_pb2.ModelStreamInferResponse()
        resp = item.infer_response
        resp.id = self.sent[0].id
        resp.outputs.add(name="context_logits", datatype="FP32", shape=list(self.logits.shape))
        resp.raw_output_contents.append(self.logits.astype("<f4").tobytes())
        resp.parameters["triton_final_response"].bool_param = True
        return item

    def cancel(self) -> None: ...


def _engine_backend(call: ScriptedCall) -> TritonBackend:
    """A TritonBackend in front of an ensemble whose tensorrt_llm step is a TensorRT engine (no kiln scoring)."""
    backend = TritonBackend("127.0.0.1:1")
    backend._contract = Contract(frozenset({"text_input", "max_tokens"}), frozenset({"text_output"}), True, True,
                                 stop_model="tensorrt_llm", score_model=None, logits_model="tensorrt_llm")

    class Stub:
        def ModelStreamInfer(self) -> ScriptedCall:  # noqa: N802 - gRPC's method name
            return call

    backend._stub = Stub()
    return backend


def test_an_engine_without_context_logits_is_refused_naming_the_key() -> None:
    call = ScriptedCall(np.zeros((1, 3, 5)))
    with pytest.raises(APIError) as info:
        asyncio.run(_engine_backend(call).score([1, 2, 3], context_logits=False))
    assert info.value.status == 400 and info.value.param == "echo"
    assert f"--set {GATHER_KEY}=true" in info.value.message
    assert call.sent == [], "nothing is sent to Triton"


def test_with_context_logits_the_server_reduces_them_to_log_probs_and_the_top_alternative() -> None:
    import torch

    rng = np.random.default_rng(0)
    ids, vocab = [4, 1, 7, 2, 9], 11
    logits = rng.normal(size=(1, len(ids), vocab)).astype(np.float32)
    call = ScriptedCall(logits)
    score = asyncio.run(_engine_backend(call).score(ids, context_logits=True))
    sent = call.sent[0]
    assert sent.model_name == "tensorrt_llm"
    names = [t.name for t in sent.inputs]
    assert "return_context_logits" in names and "return_prompt_log_probs" not in names
    assert [o.name for o in sent.outputs] == ["context_logits"]
    lp = torch.log_softmax(torch.tensor(logits[0], dtype=torch.float64), dim=-1)  # the direct computation
    assert score.log_probs[0] == 0.0 and score.top_ids[0] == -1
    assert np.allclose(score.log_probs[1:], [lp[j - 1, ids[j]].item() for j in range(1, len(ids))], atol=1e-6)
    assert score.top_ids[1:] == lp.argmax(-1).tolist()
    assert np.allclose(score.top_log_probs[1:], lp.max(-1).values.tolist(), atol=1e-6)
    assert len(score.top_ids) == len(ids) + 1, "entry n: the greedy next token"
    assert score_from_logits(logits, ids) == score
    assert score_from_logits(logits, ids, block=2) == score, "the same, a few rows at a time"


def test_kiln_json_records_it(default_build) -> None:
    _, _, repo = default_build
    info = json.loads((repo / "kiln.json").read_text())
    assert info["engine"]["gather_context_logits"] is False
    cfg = json.loads((repo / "tensorrt_llm" / "1" / "engine" / "config.json").read_text())
    assert cfg["build_config"]["gather_context_logits"] is False
