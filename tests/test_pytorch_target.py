"""Target pytorch end to end on the CPU: the default recipe built with --set target=pytorch (ModelOpt's unified
checkpoint, the same quality gate, no engine, Triton's llmapi repository), served by a real tritonserver with kiln's
CPU reference runtime (a test and development vehicle) behind the llmapi tensor contract: HTTP generate and gRPC
streaming answer exactly what Hugging Face generate answers on the ModelOpt-restored model, bad requests get clear
errors, and the requests tensorrtllm_backend's own end_to_end_test.py --test-llmapi sent (tests/data/llmapi_replay,
recorded from the real script) replay against it. One build and two servers (streaming and not) serve every test."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import requests

from kiln.pipeline.runner import Layout, run
from kiln.recipe.catalog import configs_dir
from kiln.recipe.loader import load_recipe
from kiln.serve.server import ServerConfig, TritonServer, free_port
from kiln.triton.repository import models_source

pytestmark = pytest.mark.integration

REPLAY = Path(__file__).resolve().parent / "data" / "llmapi_replay"
PROMPTS = ["def fibonacci(n):", "import os\nimport", "The quick brown fox", "# Copyright"]
MAX_TOKENS = 24
DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams default, which a request without max_tokens gets


def _build(layout: Layout, *overrides: str):
    loaded = load_recipe(configs_dir() / "tiny-llama.yaml", ["target=pytorch", *overrides])
    summary = run(loaded, layout, progress=False)
    assert summary.failure is None, summary.failure
    return loaded, layout.repo_root / loaded.recipe.name


@pytest.fixture(scope="module")
def built(pytorch_build):
    return pytorch_build  # the session's one pytorch build (tests/conftest.py)


@pytest.fixture(scope="module")
def server(pytorch_server):
    return pytorch_server  # the session's Triton llmapi server over it


@pytest.fixture(scope="module")
def unary_server(built):
    """The same recipe packaged with serving.streaming: false (upstream's default triton_config: HTTP infer of a
    decoupled model is refused by Triton itself). Its quantize output is the first build's, hard-linked."""
    _, layout, _ = built
    loaded, repo = _build(layout, "name=tiny-llama-unary", "serving.streaming=false")
    quantize = json.loads((layout.build_root / "tiny-llama-unary" / "quantize" / "manifest.json").read_text())
    assert quantize["reused_from"]  # no second calibration
    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with TritonServer(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def restored(built):
    """The ModelOpt-restored model (checkpoint/ + modelopt_state.pth) and its tokenizer."""
    import modelopt.torch.opt as mto
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, layout, _ = built
    ckpt = layout.build_root / "tiny-llama" / "quantize" / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    mto.restore(model, str(ckpt / "modelopt_state.pth"))
    return model, AutoTokenizer.from_pretrained(ckpt)


def hf_greedy(restored, prompt: str, max_tokens: int) -> str:
    import torch

    model, tok = restored
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


@pytest.fixture(scope="module")
def greedy(restored):
    return {p: hf_greedy(restored, p, MAX_TOKENS) for p in PROMPTS}


def generate(server, body: dict) -> requests.Response:
    return requests.post(f"{server.urls()['http']}/v2/models/tensorrt_llm/generate", json=body, timeout=120)


# --------------------------------------------------------------------------------------------------- the build


def test_the_build_exported_a_unified_checkpoint_and_says_who_made_it(built) -> None:
    _, layout, repo = built
    root = layout.build_root / "tiny-llama"
    quantize = json.loads((root / "quantize" / "manifest.json").read_text())["result"]
    assert quantize["unified_checkpoint"] == "unified_checkpoint" and quantize["trtllm_checkpoint"] is None
    assert quantize["produced_by"]["environment"].startswith("host") and quantize["produced_by"]["modelopt"]
    record = json.loads((root / "quantize" / "checkpoint" / "kiln_quantization.json").read_text())
    assert record["export"].startswith("modelopt.torch.export.export_hf_checkpoint")
    hf = json.loads((root / "quantize" / "unified_checkpoint" / "hf_quant_config.json").read_text())
    assert hf["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert hf["producer"]["version"] == quantize["produced_by"]["modelopt"]
    engine = json.loads((root / "engine" / "manifest.json").read_text())["result"]
    assert engine["runtime"] == "pytorch" and not (root / "engine" / "trtllm_engine").exists()
    quality = json.loads((root / "evaluate" / "quality.json").read_text())
    assert quality["graded_in"] == "host" and quality["ppl_increase_pct"] < 15.0  # the recipe's gate held


def test_the_repository_is_llmapi_shaped_and_lints(built) -> None:
    from kiln.triton.llmapi_repository import check_model_yaml
    import yaml

    _, _, repo = built
    info = json.loads((repo / "kiln.json").read_text())
    assert info["target"] == "pytorch" and info["layout"] == "llmapi" and info["models"] == ["tensorrt_llm"]
    assert "test and development vehicle" in info["runtime"] and info["container"] is None
    data = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert check_model_yaml(data) == [] and data["model"] == "checkpoint"
    assert (repo / "tensorrt_llm" / "1" / "checkpoint" / "hf_quant_config.json").is_file()
    assert subprocess.run([sys.executable, "-m", "kiln", "lint", str(repo)], capture_output=True).returncode == 0


def test_reference_logits_match_the_restored_model_on_the_built_checkpoint(built, restored) -> None:
    """The default format (INT4 AWQ) on the pipeline's own checkpoint: within 1e-5 of the largest logit."""
    import torch

    sys.path.insert(0, str(models_source() / "llmapi"))
    try:
        import kiln_llmapi_reference as ref
    finally:
        sys.path.pop(0)
    version = built[2] / "tensorrt_llm" / "1"
    model, quant = ref.load_unified_checkpoint(str(version / "checkpoint"), "auto",
                                               ref.read_layouts(str(version / "kiln_dequantize.json")))
    assert quant["quant_algo"] == "W4A16_AWQ"
    hf, tok = restored
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            want, got = hf(input_ids=ids).logits, model(input_ids=ids).logits
            assert float((want - got).abs().max()) <= 1e-5 * float(want.abs().max()), prompt


# --------------------------------------------------------------------------------------------------- serving


def test_the_served_config_is_what_the_recipe_says(built, server) -> None:
    loaded = built[0]
    served = requests.get(f"{server.urls()['http']}/v2/models/tensorrt_llm/config", timeout=30).json()
    assert served["max_batch_size"] == 0  # triton_config.max_batch_size
    assert served["model_transaction_policy"]["decoupled"] is loaded.recipe.serving.streaming is True
    assert served["parameters"]["runtime"]["string_value"] == "reference"
    assert {i["name"] for i in served["input"]} >= {"text_input", "streaming", "sampling_param_max_tokens"}


def test_greedy_http_generate_equals_hf_generate(server, greedy, restored) -> None:
    for prompt, expected in greedy.items():
        r = generate(server, {"text_input": prompt, "sampling_param_max_tokens": MAX_TOKENS})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == expected
    prompt = PROMPTS[0]
    echoed = generate(server, {"text_input": prompt, "sampling_param_max_tokens": MAX_TOKENS,
                               "sampling_param_exclude_input_from_output": False, "return_finish_reason": True})
    assert echoed.json()["text_output"] == prompt + greedy[prompt]  # upstream's default: the prompt in front
    assert echoed.json()["finish_reason"] == "length"


def _stream(grpc_url: str, inputs: list, outputs=None, request_id: str = "") -> list:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), results))
    client.async_stream_infer("tensorrt_llm", inputs, outputs=outputs, request_id=request_id,
                              enable_empty_final_response=True)
    got = []
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            client.stop_stream()
            raise RuntimeError(str(error))
        response = result.get_response()
        if result.as_numpy("text_output") is not None:
            got.append(result)
        if response.parameters.get("triton_final_response") and response.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return got


def _inputs(values: dict) -> list:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, array in values.items():
        t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def test_grpc_streaming_sends_the_cumulative_text_token_by_token(server, greedy) -> None:
    for prompt, expected in greedy.items():
        results = _stream(server.urls()["grpc"], _inputs({
            "text_input": np.array([prompt.encode()], dtype=object), "streaming": np.array([True]),
            "sampling_param_max_tokens": np.array([MAX_TOKENS], dtype=np.int32)}))
        texts = [r.as_numpy("text_output")[0].decode() for r in results]
        assert len(texts) > 1 and texts[-1] == expected
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # the LLM API's text: cumulative


@pytest.mark.parametrize("body, needle", [
    ({"sampling_param_max_tokens": 4}, "text_input is missing from the request"),
    ({"text_input": "hi", "sampling_param_max_tokens": 100000}, "exceeds max_seq_len 512"),
    ({"text_input": " ".join(map(str, range(2000))), "sampling_param_max_tokens": 4},
     "should not exceed max_num_tokens (2048)"),
    ({"text_input": "hi", "sampling_param_max_tokens": -3}, "max_tokens must be at least 1"),
    ({"text_input": "hi", "sampling_param_max_tokens": 4, "sampling_param_best_of": 2}, "best_of=2"),
    ({"text_input": "hi", "sampling_param_max_tokens": 4, "sampling_param_top_p": 1.5}, "top_p must be in [0, 1]"),
])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, greedy, body, needle) -> None:
    r = generate(server, body)
    assert r.status_code >= 400 and needle in r.json()["error"], r.text
    ok = generate(server, {"text_input": PROMPTS[0], "sampling_param_max_tokens": MAX_TOKENS})
    assert ok.status_code == 200 and ok.json()["text_output"] == greedy[PROMPTS[0]]


def test_malformed_tensors_get_clear_errors(server, unary_server) -> None:
    with pytest.raises(RuntimeError, match=r"unexpected shape for input 'text_input'.*Expected \[-1\]"):
        _stream(server.urls()["grpc"], _inputs({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}))  # Triton's
    with pytest.raises(RuntimeError, match="text_input must be a 1-D tensor holding one prompt"):  # the model's
        _stream(server.urls()["grpc"], _inputs({"text_input": np.array([], dtype=object)}))
    with pytest.raises(RuntimeError, match="'sampling_param_max_tokens' data-type is 'INT64'"):  # Triton's check
        _stream(server.urls()["grpc"], _inputs({"text_input": np.array([b"hi"], dtype=object),
                                                "sampling_param_max_tokens": np.array([4], dtype=np.int64)}))
    r = generate(unary_server, {"text_input": "hi", "sampling_param_max_tokens": 4, "streaming": True})
    assert r.status_code >= 400 and "streaming needs a decoupled model" in r.json()["error"]


# --------------------------------------------------------------------------------------------------- the replay


def _replay_inputs(record: dict, module) -> list:
    from tritonclient.utils import triton_to_np_dtype

    out = []
    for name, spec in record["inputs"].items():
        dtype = object if spec["datatype"] == "BYTES" else triton_to_np_dtype(spec["datatype"])
        data = [s.encode() for s in spec["data"]] if spec["datatype"] == "BYTES" else spec["data"]
        array = np.array(data, dtype=dtype).reshape(spec["shape"])
        t = module.InferInput(name, spec["shape"], spec["datatype"])
        t.set_data_from_numpy(array)
        out.append(t)
    return out


def _expected(record: dict, restored, cache: dict) -> str:
    prompt = record["inputs"]["text_input"]["data"][0]
    tokens = record["inputs"].get("sampling_param_max_tokens", {"data": [DEFAULT_MAX_TOKENS]})["data"][0]
    if (prompt, tokens) not in cache:
        cache[prompt, tokens] = hf_greedy(restored, prompt, tokens)
    return cache[prompt, tokens]


def test_replay_of_upstreams_end_to_end_test_llmapi_over_grpc_streaming(server, restored) -> None:
    fixture = json.loads((REPLAY / "grpc_stream.json").read_text())
    assert fixture["source"]["script"] == "tools/inflight_batcher_llm/end_to_end_test.py"
    assert fixture["script_exit_status"] == 0 and len(fixture["requests"]) == 36
    import tritonclient.grpc as grpcclient

    cache: dict = {}
    for record in fixture["requests"]:
        outputs = [grpcclient.InferRequestedOutput(n) for n in record["outputs"]]
        results = _stream(server.urls()["grpc"], _replay_inputs(record, grpcclient), outputs, record["request_id"])
        final = results[-1]
        text = final.as_numpy("text_output")[0].decode("utf-8")
        assert text == _expected(record, restored, cache)  # what the script checks (non-empty text), and exactly
        for name in ("finish_reason", "stop_reason"):
            if name in record["outputs"]:
                assert final.as_numpy(name) is not None and final.as_numpy(name).size == 1
        if "finish_reason" in record["outputs"]:
            assert final.as_numpy("finish_reason")[0] == b"length"


def test_replay_of_upstreams_end_to_end_test_llmapi_over_http(unary_server, restored) -> None:
    fixture = json.loads((REPLAY / "http.json").read_text())
    assert fixture["transport"] == "http" and fixture["script_exit_status"] == 0
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(unary_server.urls()["http"].removeprefix("http://"))
    declared = {o["name"] for o in requests.get(f"{unary_server.urls()['http']}/v2/models/tensorrt_llm/config",
                                                timeout=30).json()["output"]}
    cache: dict = {}
    for record in fixture["requests"]:
        asked = None if set(record["outputs"]) == declared else [httpclient.InferRequestedOutput(n)
                                                                  for n in record["outputs"]]
        result = client.infer("tensorrt_llm", _replay_inputs(record, httpclient), outputs=asked,
                              request_id=record["request_id"])
        assert result.as_numpy("text_output")[0].decode("utf-8") == _expected(record, restored, cache)


def test_cancellation_by_the_client_and_by_a_stop_request(server, greedy) -> None:
    """A client that cancels its stream, and upstream's `stop` input naming a running request's id: the generation
    is aborted, the request ends with Triton's CANCELLED error, and the server keeps serving."""
    import time

    import tritonclient.grpc as grpcclient

    long = _inputs({"text_input": np.array([PROMPTS[0].encode()], dtype=object), "streaming": np.array([True]),
                    "sampling_param_max_tokens": np.array([400], dtype=np.int32)})
    for how in ("client", "stop"):
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.urls()["grpc"])
        client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), results))
        client.async_stream_infer("tensorrt_llm", long, request_id=f"cancel-{how}")
        first, error = results.get(timeout=60)
        assert error is None and first.as_numpy("text_output") is not None  # it is generating
        if how == "client":
            client.stop_stream(cancel_requests=True)
        else:
            stopper = _inputs({"text_input": np.array([b""], dtype=object), "stop": np.array([True])})
            with pytest.raises(RuntimeError, match="Request cancelled by client"):
                _stream(server.urls()["grpc"], stopper, request_id=f"cancel-{how}")
            deadline = time.monotonic() + 30
            while True:  # the running request ends with the cancellation, well before 400 tokens
                result, error = results.get(timeout=max(1, deadline - time.monotonic()))
                if error is not None:
                    assert "cancelled" in str(error).lower()
                    break
            client.stop_stream()
        client.close()
    ok = generate(server, {"text_input": PROMPTS[0], "sampling_param_max_tokens": MAX_TOKENS})
    assert ok.status_code == 200 and ok.json()["text_output"] == greedy[PROMPTS[0]]
    log = server.log_tail(400)
    assert "request 'cancel-client' cancelled: generation aborted" in log  # Triton's cancel reached the engine
    assert "request 'cancel-stop' cancelled: generation aborted" in log


def test_prompt_scoring_equals_a_direct_forward_pass(server, restored) -> None:
    """kiln's return_prompt_log_probs on the llmapi model (SamplingParams(prompt_logprobs=1) on the GPU; the CPU
    reference runtime from its logits): each prompt token's log-prob and the argmax alternative, over gRPC."""
    import torch
    import tritonclient.grpc as grpcclient

    model, tok = restored
    prompt = PROMPTS[0]
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    n = ids.shape[1]
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    flag = grpcclient.InferInput("return_prompt_log_probs", [1], "BOOL")
    flag.set_data_from_numpy(np.array([True]))
    names = ("prompt_log_probs", "prompt_top_ids", "prompt_top_log_probs")
    client = grpcclient.InferenceServerClient(server.urls()["grpc"])
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
    try:
        client.async_stream_infer("tensorrt_llm", [text, flag], outputs=[grpcclient.InferRequestedOutput(x)
                                                                       for x in names])
        result, error = answers.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert error is None, error
    got = {x: result.as_numpy(x) for x in names}
    want_chosen = [0.0] + [lp[j - 1, ids[0, j]].item() for j in range(1, n)]
    assert np.allclose(got["prompt_log_probs"], want_chosen, atol=1e-4)
    top_lp, top_ids = lp.max(dim=-1)
    assert got["prompt_top_ids"].tolist() == [-1] + top_ids.tolist(), "entry n: the greedy next token"
    assert np.allclose(got["prompt_top_log_probs"], [0.0] + top_lp.tolist(), atol=1e-4)
