"""NVIDIA's own Triton clients, unchanged, against kiln's repository: requests they sent, replayed.

Each fixture in tests/fixtures/upstream_clients/ holds the requests one upstream script (tensorrtllm_backend at
the commit named in the file) sent when it was run once against kiln's default recipe through a recording proxy
(record.py; capture.sh has the commands; the script's own output is in the .log beside it). Here each request
goes again to a real tritonserver serving the default recipe, the way the script sent it (gRPC streaming API or
plain ``infer``), and the answer is read the way the script reads it (``text_output[0].decode()``, appended or
overwritten, ``output_ids[0][0]``, ...). Streaming clients run against the decoupled default; end_to_end_test.py,
which uses plain ``infer``, against ``serving.streaming=false``, over gRPC and HTTP.
"""

from __future__ import annotations

import json
import queue
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).parent / "fixtures" / "upstream_clients"
UPSTREAM_COMMIT = "c2e65b88d85255be30cf50440a91662abeb497dd"


def load(name: str) -> dict[str, Any]:
    fixture = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    assert fixture["upstream"]["commit"] == UPSTREAM_COMMIT and fixture["requests"], name
    return fixture


def array(spec: dict[str, Any]) -> np.ndarray:
    """A recorded input's value as the numpy array the script built."""
    from tritonclient.utils import triton_to_np_dtype

    if spec["datatype"] == "BYTES":
        flat = [v.encode("utf-8") for v in np.array(spec["value"], dtype=object).reshape(-1)]
        return np.array(flat, dtype=object).reshape(spec["shape"])
    return np.array(spec["value"], dtype=triton_to_np_dtype(spec["datatype"])).reshape(spec["shape"])


def inputs_for(request: dict[str, Any], protocol: str) -> list[Any]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    client = grpcclient if protocol == "grpc" else httpclient
    out = []
    for spec in request["inputs"]:
        tensor = client.InferInput(spec["name"], spec["shape"], spec["datatype"])
        tensor.set_data_from_numpy(array(spec))
        out.append(tensor)
    return out


def replay_stream(server: Any, request: dict[str, Any]) -> list[Any]:
    """start_stream / async_stream_infer / stop_stream, as the scripts do; the results (or errors) in order."""
    import tritonclient.grpc as grpcclient

    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.urls()["grpc"])
    try:
        client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), results))
        outputs = [grpcclient.InferRequestedOutput(n) for n in request["outputs"]] or None
        client.async_stream_infer(request["model"], inputs_for(request, "grpc"), outputs=outputs,
                                  request_id=request["id"])
        client.stop_stream()  # waits for the server to close the stream
    finally:
        client.close()
    return [results.get_nowait() for _ in range(results.qsize())]


def replay_infer(server: Any, request: dict[str, Any], protocol: str = "grpc") -> Any:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    client_mod = grpcclient if protocol == "grpc" else httpclient
    client = client_mod.InferenceServerClient(server.urls()[protocol].removeprefix("http://"))
    try:
        outputs = [client_mod.InferRequestedOutput(n) for n in request["outputs"]] or None
        return client.infer(request["model"], inputs_for(request, protocol), outputs=outputs, request_id=request["id"])
    finally:
        client.close()


def only_results(items: list[Any]) -> list[Any]:
    from tritonclient.utils import InferenceServerException

    errors = [str(x) for x in items if isinstance(x, InferenceServerException)]
    assert not errors, errors
    return items


def recorded(request: dict[str, Any], name: str) -> np.ndarray:
    return array(next(i for i in request["inputs"] if i["name"] == name))


# ============================================================================ end_to_end_grpc_client.py
def test_end_to_end_grpc_client_streaming_ensemble_and_bls(tiny_server, tiny_greedy):
    """`-S`: every response's text_output[0] is bytes, appended (accumulate_tokens false: deltas)."""
    for name in ("e2e_grpc_client_stream", "e2e_grpc_client_bls_stream"):
        [request] = load(name)["requests"]
        prompt = recorded(request, "text_input")[0, 0].decode()
        max_tokens = int(recorded(request, "max_tokens")[0, 0])
        results = only_results(replay_stream(tiny_server, request))
        text = ""
        for result in results:
            output = result.as_numpy("text_output")
            text += output[0].decode("utf-8")  # the script's own line
        assert len(results) > 1, f"{name}: tokens arrive as they are generated"
        assert text == tiny_greedy(prompt, max_tokens)[2], name


def test_end_to_end_grpc_client_non_streaming_with_and_without_log_probs(tiny_server, tiny_greedy):
    for name in ("e2e_grpc_client", "e2e_grpc_client_log_probs"):
        [request] = load(name)["requests"]
        prompt = recorded(request, "text_input")[0, 0].decode()
        max_tokens = int(recorded(request, "max_tokens")[0, 0])
        [result] = only_results(replay_stream(tiny_server, request))
        output_text = result.as_numpy("text_output")[0].decode("utf-8")
        assert output_text == prompt + tiny_greedy(prompt, max_tokens)[2], "exclude_input_in_output=false: prompt too"
        if "return_log_probs" in {i["name"] for i in request["inputs"]}:
            lp, cum = result.as_numpy("output_log_probs"), result.as_numpy("cum_log_probs")
            assert lp.shape == (1, 1, max_tokens) and (lp <= 0).all()
            assert cum.shape == (1, 1) and np.isclose(cum[0, 0], lp.sum(), atol=1e-3)


# ============================================================================ end_to_end_test.py (manual chain)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_end_to_end_test_manual_chain_equals_ensemble_and_bls(tiny_server_nonstreaming, tiny_greedy, protocol):
    """preprocessing -> tensorrt_llm -> postprocessing by hand, then the ensemble and the BLS, with log probs: the
    script's assertions (output0 == ensemble_output == bls_output, log probs equal)."""
    requests = load("end_to_end_test")["requests"]
    pre, llm, post, ens, bls = requests[:5]
    server = tiny_server_nonstreaming
    result = replay_infer(server, pre, protocol)
    chain = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths", "REQUEST_OUTPUT_LEN": "request_output_len",
             "DECODER_INPUT_ID": "decoder_input_ids", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id"}
    for output, llm_input in chain.items():  # what the script read and passed on, still what preprocessing returns
        assert np.array_equal(result.as_numpy(output), recorded(llm, llm_input)), output

    result = replay_infer(server, llm, protocol)
    output_ids = result.as_numpy("output_ids").astype(np.int32)
    seq_lengths = result.as_numpy("sequence_length")
    cum_log_probs = result.as_numpy("cum_log_probs").astype(np.float32)
    output_log_probs = result.as_numpy("output_log_probs").astype(np.float32)
    assert np.array_equal(output_ids, recorded(post, "TOKENS_BATCH")), "deterministic: the recorded chain"

    output0 = replay_infer(server, post, protocol).as_numpy("OUTPUT")
    result = replay_infer(server, ens, protocol)
    ensemble_output = result.as_numpy("text_output")
    assert output0 == ensemble_output  # the script's assertions, verbatim
    assert cum_log_probs == result.as_numpy("cum_log_probs")
    assert (output_log_probs == result.as_numpy("output_log_probs")).all()
    prompt, max_tokens = recorded(pre, "QUERY")[0, 0].decode(), int(recorded(pre, "REQUEST_OUTPUT_LEN")[0, 0])
    assert output0.shape == (1,) and output0[0].decode() == tiny_greedy(prompt, max_tokens)[2], (
        "one flat string per batch item; the recipe's exclude_input_in_output (true) applies")
    bls_output = replay_infer(server, bls, protocol).as_numpy("text_output")
    assert output0 == bls_output
    for request in requests[5:]:  # the script's performance phase: ensemble requests
        assert replay_infer(server, request, protocol).as_numpy("text_output")[0] == output0[0]
    assert seq_lengths.tolist() == [[output_ids.shape[2]]]


# ============================================================================ inflight_batcher_llm_client.py
def test_inflight_batcher_llm_client_streams_tokens_from_tensorrt_llm(tiny_server, tiny_greedy):
    [request] = load("inflight_batcher_llm_client_stream")["requests"]
    assert request["model"] == "tensorrt_llm"
    input_ids = recorded(request, "input_ids")[0].tolist()
    tokens: list[int] = []
    for result in only_results(replay_stream(tiny_server, request)):
        output_ids = result.as_numpy("output_ids")
        seq_lens = result.as_numpy("sequence_length")
        if seq_lens is None or seq_lens[0][0] > 0:
            tokens += list(output_ids[0][0])  # the script's callback
    expected = tiny_greedy(input_ids, int(recorded(request, "request_output_len")[0, 0]))[1]
    assert tokens == expected


# ============================================================================ the speculative-decoding client
def test_speculative_decoding_client_inputs_are_accepted(tiny_server, tiny_greedy):
    """speculative_decoding_test.py --execute-bls-speculative-decoding sends use_draft_logits and num_draft_tokens to
    the BLS. Both are accepted; without a draft model the request is refused by name (as upstream's BLS refuses it),
    never as an unexpected input. The control request through the ensemble answers as usual."""
    control, speculative = load("speculative_decoding_bls")["requests"]
    [result] = only_results(replay_stream(tiny_server, control))
    prompt = recorded(control, "text_input")[0, 0].decode()
    assert result.as_numpy("text_output")[0].decode() == prompt + tiny_greedy(prompt, 13)[2]
    assert {"use_draft_logits", "num_draft_tokens"} <= {i["name"] for i in speculative["inputs"]}
    [error] = replay_stream(tiny_server, speculative)
    assert "needs a draft model" in str(error) and "unexpected" not in str(error)


def test_inflight_batcher_llm_client_request_as_a_batch_of_two_is_answered_per_item(tiny_server, tiny_greedy):
    """The recorded request with its batch made 2 (the recorded prompt and a shorter one, padded: upstream's
    tensor contract allows any batch): as upstream's backend answers it (inflight_batcher_llm/src/
    model_instance_state.cc at c2e65b8), each item streams on its own with batch_index [[i]] and its tokens."""
    import copy

    [request] = load("inflight_batcher_llm_client_stream")["requests"]
    request = copy.deepcopy(request)
    prompt = recorded(request, "input_ids")[0].tolist()
    second = prompt[:6]
    for spec in request["inputs"]:
        if spec["name"] == "input_ids":
            spec["value"] = [prompt, second + [0] * (len(prompt) - len(second))]
        elif spec["name"] == "input_lengths":
            spec["value"] = [[len(prompt)], [len(second)]]
        else:
            spec["value"] = spec["value"] * 2
        spec["shape"] = [2, *spec["shape"][1:]]
    n = int(recorded(request, "request_output_len")[0, 0])
    tokens: dict[int, list[int]] = {}
    for result in only_results(replay_stream(tiny_server, request)):
        index, output_ids = result.as_numpy("batch_index"), result.as_numpy("output_ids")
        assert index is not None and index.shape == (1, 1) and output_ids.shape[:2] == (1, 1)
        tokens.setdefault(int(index[0, 0]), []).extend(output_ids[0, 0, : result.as_numpy("sequence_length")[0, 0]])
    assert tokens == {0: tiny_greedy(prompt, n)[1], 1: tiny_greedy(second, n)[1]}
