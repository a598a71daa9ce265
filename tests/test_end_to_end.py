"""The whole path on the CPU: the default recipe built by the pipeline, served by a real tritonserver, answered
exactly as Hugging Face `generate` answers with the same quantized model, and measured by `kiln bench`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import requests

from kiln.serve.bench import BenchConfig, run_bench
from kiln.serve.client import GenerationError, generate_http, generate_stream
from kiln.serve.server import free_port

pytestmark = pytest.mark.integration

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Config:\n    \"\"\"", "The quick brown fox",
           "for i in range(10):", "# Copyright"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def built(default_build):
    """The default recipe built by the pipeline (shared with other modules: see conftest.default_build)."""
    return default_build


@pytest.fixture(scope="module")
def server(default_server):
    """One tritonserver for the session (conftest.default_server)."""
    return default_server


@pytest.fixture(scope="module")
def greedy_reference(hf_greedy):
    """Greedy completions from Hugging Face generate on the same quantized model (ModelOpt state restored)."""
    return {prompt: hf_greedy(prompt, MAX_TOKENS) for prompt in PROMPTS}


def test_repository_is_complete_and_lints(built):
    loaded, _, repo = built
    info = json.loads((repo / "kiln.json").read_text())
    assert info["target"] == "reference" and "test and development vehicle" in info["runtime"]
    assert subprocess.run([sys.executable, "-m", "kiln", "lint", str(repo)]).returncode == 0


def test_greedy_http_generate_equals_hf_generate(server, greedy_reference):
    http = server.urls()["http"]
    for prompt, expected in greedy_reference.items():
        # the request shape existing Triton TensorRT-LLM clients send
        body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": ""}
        r = requests.post(f"{http}/v2/models/ensemble/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == expected
        assert generate_http(http, prompt, MAX_TOKENS) == expected


def test_grpc_streaming_yields_the_same_tokens_incrementally(server, greedy_reference):
    grpc = server.urls()["grpc"]
    for prompt, expected in greedy_reference.items():
        pieces = list(generate_stream(grpc, prompt, MAX_TOKENS))
        assert "".join(pieces) == expected
        assert len(pieces) > 1  # incremental, not one final chunk
    bls = "".join(generate_stream(grpc, PROMPTS[0], MAX_TOKENS, model="tensorrt_llm_bls"))
    assert bls == greedy_reference[PROMPTS[0]]


@pytest.mark.parametrize("body,needle", [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "hello", "max_tokens": -3}, "max_tokens must be at least 1"),
    ({"text_input": "hello", "max_tokens": 10_000_000}, "exceeds this model's max_seq_len"),
    ({"text_input": "word " * 3000, "max_tokens": 4}, "max_input_len"),
    ({"text_input": "hello", "max_tokens": "many"}, "parse"),
])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, body, needle, greedy_reference):
    http = server.urls()["http"]
    r = requests.post(f"{http}/v2/models/ensemble/generate", json=body, timeout=60)
    assert r.status_code >= 400 and "error" in r.json()
    assert needle in r.json()["error"]
    ok = requests.post(f"{http}/v2/models/ensemble/generate",
                       json={"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS}, timeout=120)
    assert ok.status_code == 200 and ok.json()["text_output"] == greedy_reference[PROMPTS[0]]
    with pytest.raises(GenerationError):
        list(generate_stream(server.urls()["grpc"], "hello", -1))


def test_bench_32_streaming_clients_zero_errors_and_greedy_outputs(server, greedy_reference, tmp_path):
    cfg = BenchConfig(url=server.urls()["grpc"], concurrency=(32,), duration_s=2, prompts=tuple(PROMPTS),
                      output_len=MAX_TOKENS, expected=greedy_reference, request_timeout_s=120)
    report = run_bench(cfg)
    level = report.levels[0]
    assert report.total_errors == 0, level.error_samples
    assert level.completed >= 32 and level.mismatches == 0
    paths = report.write(tmp_path)
    assert json.loads(paths["json"].read_text())["levels"][0]["completed"] == level.completed
    assert paths["png"].stat().st_size > 1000


def test_serve_of_a_broken_repository_exits_nonzero_with_the_reason(built, tmp_path):
    _, _, repo = built
    broken = tmp_path / "broken"
    shutil.copytree(repo, broken, ignore=shutil.ignore_patterns("checkpoint"))
    (broken / "tensorrt_llm" / "1" / "checkpoint").mkdir()  # the quantized model is gone
    proc = subprocess.run([sys.executable, "-m", "kiln", "serve", str(broken), "--http-port", str(free_port()),
                           "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--timeout", "120"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "config.json not found" in proc.stderr and "Traceback" not in proc.stderr.split("--- last lines")[0]
