"""kiln's OpenAI app against an in-process backend that fails on command (no tritonserver): a mid-stream error
ends as OpenAI's streams do (an error event, then ``data: [DONE]``), ``usage`` sums every response's tokens, a
non-streaming ``stop`` request ends the Triton request at the stop text, and the requests the backend builds for
Triton (internal streaming for stop/log-probs, ``end_id`` for ``ignore_eos``, ``min_tokens``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kiln.serve.openai.app import ModelInfo, create_app
from kiln.serve.openai.backend import Chunk, Contract, Score, TritonBackend
from kiln.serve.openai.protocol import APIError, parse_request


class ScriptedBackend:
    """Stands in for :class:`TritonBackend` (same ``open/close/ready/generate/score`` methods): yields the scripted
    chunks, raises ``APIError`` at ``fail_at`` and records how many chunks were taken and whether it was closed
    early (what cancels the Triton request)."""

    def __init__(self, chunks: list[Chunk], fail_at: int | None = None) -> None:
        self.chunks, self.fail_at = chunks, fail_at
        self.taken = 0
        self.closed_early = False
        self.scored: list[list[int]] = []

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def ready(self) -> bool:
        return True

    async def generate(self, req: Any, prompt: str, max_tokens: int):
        done = False
        try:
            for i, chunk in enumerate(self.chunks):
                if i == self.fail_at:
                    done = True
                    raise APIError(400, "the model failed on command")
                self.taken += 1
                yield chunk
            done = True
        finally:
            self.closed_early = not done

    async def score(self, ids: list[int], context_logits: bool | None = None) -> Score:
        self.scored.append(ids)
        n = len(ids)
        return Score([0.0] + [-1.0 * j for j in range(1, n)], [-1] + [7] * n, [0.0] + [-0.5] * n)


def client_for(backend: ScriptedBackend):
    from starlette.testclient import TestClient

    from kiln.serve.openai.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {}, "test")
    return TestClient(create_app(backend, ModelInfo(name="m", template=template)))  # type: ignore[arg-type]


def events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def tokens(*texts: str, first_input: int = 3) -> list[Chunk]:
    return [Chunk(text=t, output_tokens=1, input_tokens=first_input if i == 0 else None) for i, t in enumerate(texts)]


@pytest.mark.parametrize("chat", [False, True])
def test_a_mid_stream_error_is_an_error_event_then_done(chat: bool) -> None:
    backend = ScriptedBackend(tokens("a", "b", "c"), fail_at=2)
    path, extra = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}) if chat else
                   ("/v1/completions", {"prompt": "x"}))
    with client_for(backend) as c:
        r = c.post(path, json={"model": "m", "stream": True, "max_tokens": 8, **extra})
    assert r.status_code == 200
    ev = events(r.text)
    assert ev[-1] == "[DONE]", "OpenAI's streams end with [DONE], after an error too"
    assert json.loads(ev[-2]) == {"error": {"message": "the model failed on command", "type": "invalid_request_error",
                                            "param": None, "code": None}}
    text_key = (lambda e: e["choices"][0]["delta"].get("content", "")) if chat else (lambda e: e["choices"][0]["text"])
    assert "".join(text_key(json.loads(e)) for e in ev[:-2]) == "ab"


def test_usage_sums_every_response_streamed_or_not() -> None:
    chunks = [Chunk(text="a", output_tokens=1, input_tokens=5), Chunk(text="bc", output_tokens=2),
              Chunk(text="def", output_tokens=3, final=True)]
    with client_for(ScriptedBackend(chunks)) as c:
        whole = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 16}).json()
        streamed = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 16, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert whole["choices"][0]["text"] == "abcdef"
    usage = [json.loads(e)["usage"] for e in events(streamed.text)[:-1] if json.loads(e).get("usage")]
    assert usage == [{"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}]


def test_a_non_streaming_stop_ends_the_triton_request_at_the_stop_text() -> None:
    backend = ScriptedBackend(tokens("    ", "return", "\n", "    x", "y", "z"))
    with client_for(backend) as c:
        out = c.post("/v1/completions", json={"model": "m", "prompt": "def f():", "max_tokens": 400,
                                              "temperature": 0, "stop": "\n"}).json()
    assert out["choices"][0]["text"] == "    return" and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 3, "the tokens generated up to the stop"
    assert backend.taken == 3 and backend.closed_early, "the request is stopped once the stop text appears"


def test_echo_answers_as_the_legacy_completions_api() -> None:
    """lm-eval reads token_logprobs[ctxlen:-1] and compares each with max(top_logprobs[i].values())."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "c": 3, "seven": 7}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    backend = ScriptedBackend([])
    from starlette.testclient import TestClient

    with TestClient(create_app(backend, ModelInfo(name="m", tokenizer=tok))) as c:  # type: ignore[arg-type]
        out = c.post("/v1/completions", json={"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 1, "echo": True,
                                              "logprobs": 1, "temperature": 0}).json()
        zero = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 0, "echo": True,
                                               "logprobs": 1}).json()
        outside = c.post("/v1/completions", json={"model": "m", "prompt": [1, 99, 100], "max_tokens": 0,
                                                  "echo": True, "logprobs": 1})
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "seven"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5]
    assert lp["top_logprobs"] == [None, {"seven": -0.5}, {"seven": -0.5}, {"seven": -0.5}]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert backend.scored[0] == [1, 2, 3], "the ids as sent"
    assert zero["choices"][0]["logprobs"]["tokens"] == ["a", "b"] and zero["usage"]["completion_tokens"] == 0
    assert outside.status_code == 400 and "[99, 100]" in outside.json()["error"]["message"]


def _inputs(msg: Any) -> dict[str, bytes]:
    return {t.name: raw for t, raw in zip(msg.inputs, msg.raw_input_contents)}


def test_backend_streams_internally_for_stop_and_logprobs_and_maps_the_extensions() -> None:
    import struct

    names = frozenset({"text_input", "max_tokens", "stream", "exclude_input_in_output", "stop_words", "end_id",
                       "min_tokens", "top_k", "return_log_probs"})
    c = Contract(names, frozenset({"text_output", "output_log_probs"}), decoupled=True, batched=True)
    backend = TritonBackend("127.0.0.1:1")

    def request(**fields: Any) -> dict[str, bytes]:
        req = parse_request(json.dumps({"model": "m", "prompt": "x", **fields}).encode(), chat=False)
        return _inputs(backend._request(req, "x", req.max_tokens, c))

    assert request()["stream"] == b"\x00", "a plain non-streaming request: one final response"
    assert request(stop="\n")["stream"] == b"\x01", "stop: streamed from Triton so it can end at the stop text"
    assert request(logprobs=0)["stream"] == b"\x01", "log-probs: one token per response"
    sent = request(ignore_eos=True, min_tokens=7)
    assert struct.unpack("<i", sent["end_id"]) == (-1,) and struct.unpack("<i", sent["min_tokens"]) == (7,)
    bare = Contract(frozenset({"text_input", "max_tokens"}), frozenset({"text_output"}), True, True)
    for fields, param in (({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")):
        req = parse_request(json.dumps({"model": "m", "prompt": "x", **fields}).encode(), chat=False)
        with pytest.raises(APIError) as info:
            backend._request(req, "x", 4, bare)
        assert info.value.status == 400 and info.value.param == param


# ============================================================================ ports from the running kiln serve
def test_infer_and_bench_use_the_running_kiln_serves_ports(tmp_path, monkeypatch, kiln) -> None:
    """The state file `kiln serve` writes (build/.serve/<repo>.json) is where infer and bench find the server."""
    import os

    from kiln.serve.session import serving_urls
    from kiln.util.errors import InputError

    monkeypatch.chdir(tmp_path)
    assert serving_urls() is None, "none running: the callers fall back to the default ports"
    state_dir = tmp_path / "build" / ".serve"
    state_dir.mkdir(parents=True)
    urls = {"http": "http://127.0.0.1:1", "grpc": "127.0.0.1:2", "metrics": "http://127.0.0.1:3/metrics",
            "openai": "http://127.0.0.1:4/v1"}
    (state_dir / "repo.json").write_text(json.dumps({"pid": os.getpid(), "repo": str(tmp_path / "repo"),
                                                     "urls": urls}))
    (state_dir / "gone.json").write_text(json.dumps({"pid": 2**22 + 12345, "urls": {"grpc": "x"}}))
    assert serving_urls() == urls and serving_urls(tmp_path / "repo") == urls
    with pytest.raises(InputError, match="no kiln serve is running for"):
        serving_urls(tmp_path / "gone")
    result = kiln("bench", "--openai", "--duration", "1", "--concurrency", "1")
    assert result.exit_code != 0 and "http://127.0.0.1:4/v1" in result.output, result.output
    result = kiln("infer", "hi", "--max-tokens", "1")
    assert result.exit_code != 0 and "127.0.0.1:2" in result.output, result.output


def test_synthetic_prompts_have_input_len_tokens_of_the_served_tokenizer() -> None:
    """A small byte-level BPE (words split into several tokens, as the tiny model's are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kiln.serve.bench.prompts import _WORDS, synthetic_prompts

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(_WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    prompts = synthetic_prompts(8, 24, seed=3, tokenizer=tok)
    assert [len(tok.encode(p, add_special_tokens=False).ids) for p in prompts] == [24] * 8
    assert len(set(prompts)) == 8
    words = synthetic_prompts(8, 24, seed=3)
    assert [len(p.split()) for p in words] == [24] * 8, "without a tokenizer: words"


def test_continuous_usage_stats_puts_the_running_usage_in_every_chunk() -> None:
    """vLLM's stream_options.continuous_usage_stats, which guidellm sends: honoured, not ignored."""
    with client_for(ScriptedBackend(tokens("a", "b", "c"))) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 8, "stream": True,
                                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    texts = [json.loads(e) for e in events(r.text)[:-1]]
    counted = [(e["choices"][0]["text"], e["usage"]["completion_tokens"]) for e in texts if e["choices"] and
               e["choices"][0]["text"]]
    assert counted == [("a", 1), ("b", 2), ("c", 3)]
