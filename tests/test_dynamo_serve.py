"""A real NVIDIA Dynamo on the CPU: Dynamo 1.6.1's own frontend (file discovery, TCP request plane, every address
127.0.0.1) in front of two kiln workers, each registered with Dynamo's runtime through its Python API (the role
dynamo.trtllm plays on a GPU) and serving kiln's CPU reference runtime (a test and development vehicle) from the
unified checkpoint of the session's pytorch build. The stack is started and stopped by `kiln serve RECIPE-REPO
--stack dynamo --background --workers 2` and `kiln stop`, and everything else talks to it: the official openai SDK
(the same greedy text as the Triton llmapi path, streamed and not; chat with the model's template), a client that
goes away, `kiln bench --openai`, and the frontend's router spreading requests over both workers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kiln.serve.dynamo import dynamo_available
from kiln.serve.server import free_port

pytestmark = pytest.mark.integration

PROMPTS = ["def fibonacci(n):", "The quick brown fox"]
MAX_TOKENS = 12


def _kiln(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def stack(pytorch_build, tmp_path_factory):
    why = dynamo_available()
    if why:
        pytest.skip(why)
    _, _, repo = pytorch_build
    cwd = tmp_path_factory.mktemp("dynamo-serve")
    port = free_port()
    started = _kiln("serve", str(repo), "--stack", "dynamo", "--workers", "2", "--http-port", str(port),
                    "--background", "--timeout", "240", cwd=cwd)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "a test and development vehicle" in started.stderr
    state_file = cwd / "build" / ".serve" / f"{repo.name}.json"
    state = json.loads(state_file.read_text())
    try:
        yield {"url": state["urls"]["openai"], "state": state, "cwd": cwd, "repo": repo, "stdout": started.stdout}
    finally:
        stopped = _kiln("stop", cwd=cwd, timeout=60)
    assert "stopped 1 server(s)" in stopped.stdout, stopped.stdout + stopped.stderr
    for pid in state["processes"].values():  # frontend and both workers are gone
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not state_file.exists()


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    return OpenAI(base_url=stack["url"], api_key="unused", max_retries=0, timeout=120)


def _triton_text(pytorch_server, prompt: str) -> str:
    r = requests.post(f"{pytorch_server.urls()['http']}/v2/models/tensorrt_llm/generate",
                      json={"text_input": prompt, "sampling_param_max_tokens": MAX_TOKENS}, timeout=120)
    assert r.ok, r.text
    return r.json()["text_output"]


def _worker_logs(stack) -> dict[str, str]:
    log_dir = Path(stack["state"]["log"])
    return {p.stem: p.read_text(errors="replace") for p in sorted(log_dir.glob("worker*.log"))}


def test_the_stack_announces_itself_and_lists_the_model(stack, client) -> None:
    assert f"openai  {stack['url']}" in stack["stdout"]
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]


def _ids(repo: Path, prompt: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(repo / "tensorrt_llm" / "1" / "checkpoint" / "tokenizer.json"))
    return tok.encode(prompt, add_special_tokens=True).ids


def test_openai_sdk_gets_the_triton_llmapi_paths_greedy_text(stack, client, pytorch_server) -> None:
    # The Triton llmapi path tokenizes text as the LLM API does (the tokenizer's special tokens: BOS first); Dynamo
    # 1.6.1's frontend tokenizes a text prompt without them. The same token ids (BOS included) give the same text.
    for prompt in PROMPTS:
        want = _triton_text(pytorch_server, prompt)
        ids = _ids(stack["repo"], prompt)
        got = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == want
        assert got.usage.completion_tokens == MAX_TOKENS and got.usage.prompt_tokens == len(ids)
        pieces = [c.choices[0].text for c in client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == want and len([p for p in pieces if p]) > 1


def test_dynamos_frontend_tokenizes_text_without_the_bos_token(stack, client) -> None:
    # what a user of Dynamo 1.6.1 meets with this tokenizer (its post-processor adds <s>; the frontend does not)
    ids = _ids(stack["repo"], PROMPTS[0])
    got = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert ids[0] == 1 and got.usage.prompt_tokens == len(ids) - 1


def test_chat_uses_the_models_template(client) -> None:
    got = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=8, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.usage.completion_tokens >= 1


def test_a_client_that_goes_away_stops_the_generation(stack) -> None:
    before = sum(log.count("cancelled by the client") for log in _worker_logs(stack).values())
    with requests.post(f"{stack['url']}/completions", stream=True, timeout=60,
                       json={"model": "tiny-llama", "prompt": PROMPTS[0], "max_tokens": 400, "stream": True,
                             "temperature": 0}) as r:
        lines = r.iter_lines()
        assert any(line.startswith(b"data: ") for line in lines)  # the first token arrived
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = _worker_logs(stack).values()
        if sum(log.count("cancelled by the client") for log in logs) > before:
            break
        time.sleep(0.3)
    stopped = [int(m) for log in _worker_logs(stack).values() for m in re.findall(
        r"cancelled by the client: the generation stopped with finish_reason cancelled after (\d+) tokens", log)]
    assert len(stopped) > before and stopped[-1] < 400  # the reference runtime's loop was aborted, not run out


def test_two_workers_behind_one_frontend_both_serve(stack, client) -> None:
    # the frontend's router (round-robin) spreads requests: each worker logs the requests it served
    counts = {name: log.count("prompt tokens") for name, log in _worker_logs(stack).items()}
    for _ in range(4):
        client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=2, temperature=0)
    after = {name: log.count("prompt tokens") for name, log in _worker_logs(stack).items()}
    assert sorted(after) == ["worker0", "worker1"]
    assert all(after[n] > counts[n] for n in after), (counts, after)


def test_kiln_bench_openai_runs_against_dynamos_frontend(stack, kiln) -> None:
    out = stack["cwd"] / "bench"
    r = kiln("bench", "--openai", stack["url"], "--concurrency", "2", "--duration", "1.5", "--input-len", "8",
             "--output-len", "4", "--out", str(out))
    assert r.exit_code == 0, r.output
    report = json.loads((out / "bench.json").read_text())
    assert report["levels"][0]["completed"] >= 1, report
