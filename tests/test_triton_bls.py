"""kiln's ``tensorrt_llm_bls`` model in process: preprocessing -> tensorrt_llm (kiln's reference runtime on a tiny
quantized Llama, plus a draft model) -> postprocessing through BLS calls on the stand-in for
``triton_python_backend_utils`` (see triton_harness). Marked ``integration`` (real ModelOpt model).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from triton_harness import (  # noqa: F401 - fixtures are used by name
    BLS_MODELS,
    PRE_OUTPUTS,
    FakeLogger,
    FakeRequest,
    FakeResponse,
    FakeTensor,
    build_tiny_model,
    error_of,
    hf_greedy,
    hf_model,
    llm,
    load_model_module,
    model_args,
    pb_utils,
    ref,
    start_reference,
    text_array,
    tiny_model,
    tokenizer,
)


# ============================================================================ tensorrt_llm_bls, in process
@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kiln-tiny-int8sq-draft", seed=1)


@pytest.fixture(scope="module")
def bls_pipeline(pb_utils: Any, ref: Any, llm: Any, tiny_model: Path, draft_model_dir: Path) -> Any:
    """preprocessing, tensorrt_llm (+ a draft model) and postprocessing reachable by BLS calls."""
    pre = load_model_module("preprocessing").TritonPythonModel()
    pre.initialize(model_args({"tokenizer_dir": tiny_model}, PRE_OUTPUTS))
    post = load_model_module("postprocessing").TritonPythonModel()
    post.initialize(model_args({"tokenizer_dir": tiny_model}, {"OUTPUT": "TYPE_STRING"}))
    draft = start_reference(ref, draft_model_dir, decoupled=True)
    BLS_MODELS.update(preprocessing=pre, postprocessing=post, tensorrt_llm=llm, draft_same=llm, draft_other=draft)
    yield load_model_module("bls")
    draft.finalize()
    BLS_MODELS.clear()


def start_bls(bls: Any, decoupled: bool = True, **params: Any) -> Any:
    model = bls.TritonPythonModel()
    model.initialize(model_args(params, {"text_output": "TYPE_STRING"}, decoupled))
    return model


def bls_text(model: Any, prompt: str, max_tokens: int, **extra: Any) -> tuple[list[str], FakeRequest]:
    inputs = {"text_input": text_array(prompt), "max_tokens": np.array([[max_tokens]], np.int32)}
    inputs.update({k: np.array([[v]]) for k, v in extra.items()})
    request = FakeRequest(inputs)
    model.execute([request])
    pieces = []
    for resp in request.sender.wait():
        assert not resp.has_error(), resp.error().message()
        out = resp.get("text_output")
        assert out.ndim == 1, "text_output is one flat array of batch x beams strings, as upstream's"
        pieces.append(out[0].decode("utf-8"))
    return pieces, request


class PerTokenLLM:
    """A stand-in for TensorRT-LLM's backend as the BLS sees it when streaming: one response per token, with no
    regard for UTF-8 character boundaries (kiln's reference runtime holds such chunks back; the GPU backend
    does not). It streams ``ids`` for any request."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def execute(self, requests: list[FakeRequest]) -> None:
        for request in requests:
            for tok in self.ids:
                request.sender.send(FakeResponse([FakeTensor("output_ids", np.array([[[tok]]], np.int32)),
                                                  FakeTensor("sequence_length", np.array([[1]], np.int32))]))
            request.sender.send(None, 1)


@pytest.mark.integration
def test_bls_streams_whole_characters_and_matches_greedy(bls_pipeline: Any, hf_model: Any, tokenizer: Any) -> None:
    bls = start_bls(bls_pipeline)
    prompt = "東京 😀 café"
    expected = tokenizer.decode(hf_greedy(hf_model, tokenizer.encode(prompt).ids, 30))
    pieces, _ = bls_text(bls, prompt, 30, stream=True)
    assert len(pieces) > 1 and "".join(pieces) == expected
    whole, _ = bls_text(bls, prompt, 30, exclude_input_in_output=True)
    assert whole == [expected]


@pytest.mark.integration
@pytest.mark.parametrize("draft", ["draft_same", "draft_other"])
def test_bls_speculative_decoding_gives_the_target_greedy_output(
    bls_pipeline: Any, hf_model: Any, tokenizer: Any, draft: str
) -> None:
    bls = start_bls(bls_pipeline, tensorrt_llm_draft_model_name=draft, num_draft_tokens=3)
    prompt = "Beautiful is better than"
    expected = tokenizer.decode(hf_greedy(hf_model, tokenizer.encode(prompt).ids, 25))
    FakeLogger.lines.clear()
    [text], _ = bls_text(bls, prompt, 25, exclude_input_in_output=True)
    assert text == expected
    [text], _ = bls_text(bls, prompt, 25)
    assert text == prompt + expected, "the prompt comes back unless exclude_input_in_output"
    streamed_text, _ = bls_text(bls, prompt, 25, stream=True)
    assert "".join(streamed_text) == expected
    rates = [m for _, m in FakeLogger.lines if "speculative decoding accepted" in m]
    assert rates, FakeLogger.lines
    if draft == "draft_same":
        assert all("(100%)" in m for m in rates), rates


@pytest.mark.integration
def test_bls_stops_the_model_request_when_the_client_cancels(bls_pipeline: Any, llm: Any) -> None:
    bls = start_bls(bls_pipeline)
    inputs = {"text_input": text_array("The quick"), "max_tokens": np.array([[1000]], np.int32),
              "stream": np.array([[True]]), "end_id": np.array([[-1]], np.int32)}
    request = FakeRequest(inputs)
    bls.execute([request])
    deadline = time.monotonic() + 60
    while not request.sender.sent and time.monotonic() < deadline:
        time.sleep(0.005)
    request.sender.cancelled = True
    request.sender.wait(timeout=30)
    deadline = time.monotonic() + 3  # generating all 1000 tokens would take far longer
    while llm._jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm._jobs, "the reference model's request was stopped too"
    assert any("stopped by a stop request" in m for _, m in FakeLogger.lines)


@pytest.mark.integration
def test_bls_reports_request_errors(bls_pipeline: Any) -> None:
    bls = start_bls(bls_pipeline, decoupled=False)
    request = FakeRequest({"text_input": text_array(""), "max_tokens": np.array([[4]], np.int32)})
    bls.execute([request])
    assert "text_input is empty" in error_of(request.sender.wait()[0])
    request = FakeRequest({"text_input": text_array("hi"), "max_tokens": np.array([[4]], np.int32),
                           "stream": np.array([[True]])})
    bls.execute([request])
    assert "decoupled" in error_of(request.sender.wait()[0])


@pytest.mark.integration
@pytest.mark.parametrize("accumulate", [False, True])
def test_bls_streaming_text_never_splits_a_character(bls_pipeline: Any, tokenizer: Any, accumulate: bool) -> None:
    """accumulate_tokens false: deltas (clients append); true: the full text so far (clients overwrite). Either
    way no response carries a split UTF-8 character, even from a backend that cuts chunks per token."""
    text = "東京 😀 café"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text), "characters spread over several tokens"
    BLS_MODELS["per_token"] = PerTokenLLM(ids)
    bls = start_bls(bls_pipeline, tensorrt_llm_model_name="per_token", accumulate_tokens=str(accumulate).lower())
    pieces, _ = bls_text(bls, "hi", 40, stream=True)
    assert not any("\ufffd" in p for p in pieces), pieces
    assert len(pieces) == len(ids), "one response per response of the language model"
    if accumulate:
        assert pieces[-1] == text and all(text.startswith(p) for p in pieces)
        assert [len(p) for p in pieces] == sorted(len(p) for p in pieces)
    else:
        assert "".join(pieces) == text and sum(1 for p in pieces if p) > 1


@pytest.mark.integration
def test_bls_accepts_every_upstream_input_and_names_what_it_cannot_do(bls_pipeline: Any) -> None:
    bls = start_bls(bls_pipeline)

    def error(**extra: Any) -> str:
        inputs = {"text_input": text_array("hi"), "max_tokens": np.array([[4]], np.int32)}
        inputs.update(extra)
        request = FakeRequest(inputs)
        bls.execute([request])
        return error_of(request.sender.wait()[0])

    url = np.array([[b"http://example.com/cat.png"]], dtype=np.object_)
    assert "image input needs a multimodal encoder model" in error(image_url_input=url)
    assert "needs a draft model" in error(num_draft_tokens=np.array([[5]], np.int32),
                                          use_draft_logits=np.array([True]))
    assert "generation logits are not produced by the reference target" in error(
        return_generation_logits=np.array([True]))
    assert "LoRA adapters are not supported by the reference target" in error(lora_task_id=np.array([3], np.uint64))
    # use_draft_logits without speculative decoding, and the decoder input of a decoder-only model: accepted
    pieces, _ = bls_text(bls, "hi", 4, use_draft_logits=False, decoder_text_input=b"x")
    assert pieces and pieces[0]


@pytest.mark.integration
def test_bls_speculative_decoding_with_use_draft_logits(bls_pipeline: Any, hf_model: Any, tokenizer: Any) -> None:
    """The speculative-decoding client's use_draft_logits: false runs token comparison; true asks the draft for
    its generation logits, which the reference target refuses by name."""
    bls = start_bls(bls_pipeline, tensorrt_llm_draft_model_name="draft_same", decoupled=False)
    prompt = "Beautiful is better than"
    expected = tokenizer.decode(hf_greedy(hf_model, tokenizer.encode(prompt).ids, 12))
    [text], _ = bls_text(bls, prompt, 12, exclude_input_in_output=True, num_draft_tokens=3, use_draft_logits=False)
    assert text == expected
    request = FakeRequest({"text_input": text_array(prompt), "max_tokens": np.array([[12]], np.int32),
                           "num_draft_tokens": np.array([[3]], np.int32), "use_draft_logits": np.array([True])})
    bls.execute([request])
    assert "generation logits are not produced by the reference target" in error_of(request.sender.wait()[0])


@pytest.mark.integration
@pytest.mark.parametrize("stream", [True, False])
def test_bls_batch_of_two_answers_each_item_with_its_batch_index(bls_pipeline: Any, hf_model: Any, tokenizer: Any,
                                                                 stream: bool) -> None:
    """tensorrt_llm answers a batch > 1 one item per response with batch_index (as upstream's backend); the BLS
    decodes each item's tokens on their own and passes the index on, as upstream's BLS (lib/decode.py)."""
    prompts = ["The quick brown fox", "Beautiful is better than"]
    model = bls_pipeline.TritonPythonModel()
    model.initialize(model_args({}, {"text_output": "TYPE_STRING", "batch_index": "TYPE_INT32"}, True))
    request = FakeRequest({"text_input": np.array([[p.encode()] for p in prompts], dtype=np.object_),
                           "max_tokens": np.array([[12], [12]], np.int32), "stream": np.array([[stream]] * 2),
                           "exclude_input_in_output": np.array([[True]] * 2)})
    model.execute([request])
    texts: dict[int, str] = {}
    for resp in request.sender.wait():
        assert not resp.has_error(), resp.error().message()
        out, index = resp.get("text_output"), resp.get("batch_index")
        assert out.shape == (1,) and index.shape == (1, 1), "one item per response, with its index"
        texts[int(index[0, 0])] = texts.get(int(index[0, 0]), "") + out[0].decode("utf-8")
    assert texts == {i: tokenizer.decode(hf_greedy(hf_model, tokenizer.encode(p).ids, 12)) for i, p in enumerate(prompts)}
