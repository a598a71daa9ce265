"""What benchmark and evaluation tools send to kiln's OpenAI server, replayed against the session's real server.

The fixtures in tests/fixtures/openai_tools/ were recorded by record.py (a proxy in front of ``kiln serve
--openai`` on configs/tiny-llama.yaml) while each tool ran once; each names the tool, its version and the command.
lm-eval 0.4.13's ``local-completions`` ran a loglikelihood task and a generate_until task over local JSONL
(lm_eval_tasks/) with its default ``tokenized_requests``: token-id prompts, ``echo`` + ``logprobs: 1`` +
``max_tokens: 1`` for loglikelihood, ``stop`` for generate_until. Replayed here, the log-probabilities and
top-1 alternatives the server returns must equal the served model's own, computed directly from the restored
checkpoint on the same ids, and the generated text must equal Hugging Face greedy decoding cut at the stop.
guidellm 0.8.1 and AIPerf 0.13 each ran a small fixed-length streaming chat benchmark (``ignore_eos``,
``min_tokens`` for AIPerf): replayed, every request gets the status it got and every stream the tokens it asked for.
None of the tools is needed here (their requests are the fixtures).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "openai_tools"


def recording(name: str) -> dict:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    assert data["tool"] and data["version"] and data["command"] and data["requests"], "fixture metadata"
    return data


def test_the_recorded_tools_send_only_fields_kiln_knows() -> None:
    """The allowlist of extensions (protocol.EXTENSIONS) is what the tools were seen to send, and every recorded
    body parses (no 400 for what a tool really sends)."""
    from kiln.serve.openai.protocol import CHAT_FIELDS, COMPLETIONS_FIELDS, EXTENSIONS, parse_request

    seen: set[str] = set()
    for path in sorted(FIXTURES.glob("*.json")):
        data = json.loads(path.read_text())
        for r in data["requests"]:
            if r["method"] != "POST":
                continue
            chat = r["path"].endswith("/chat/completions")
            parse_request(json.dumps(r["body"]).encode(), chat=chat)
            seen |= set(r["body"]) - (CHAT_FIELDS if chat else COMPLETIONS_FIELDS)
    assert seen <= EXTENSIONS


@pytest.fixture(scope="module")
def scorer(tiny_build):
    """``score(ids) -> (log_probs, top_ids, top_log_probs)`` from the served checkpoint (ModelOpt state restored),
    one forward pass, as a reference for what the server returns."""
    import modelopt.torch.opt as mto
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = tiny_build[2] / "tensorrt_llm" / "1" / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").eval()
    mto.restore(model, str(ckpt / "modelopt_state.pth"))

    def score(ids: list[int]):
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(x, attention_mask=torch.ones_like(x)).logits[0].float(), dim=-1)
        top_lp, top_ids = lp.max(dim=-1)
        chosen = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        return chosen, top_ids.tolist(), top_lp.tolist()

    return score


@pytest.mark.integration
def test_lm_eval_requests_replayed_get_the_served_models_own_log_probs(openai_api, scorer, tiny_server,
                                                                       tiny_build) -> None:
    """Loglikelihood: equal to the restored checkpoint's own log-probs; generate_until: the ensemble's greedy text
    for the ids' text (test_openai shows that equals Hugging Face greedy decoding), cut at the first stop."""
    import httpx
    from tokenizers import Tokenizer

    from kiln.serve.client import generate_http

    data = recording("lm_eval")
    tok = Tokenizer.from_file(str(tiny_build[2] / "preprocessing" / "1" / "tokenizer" / "tokenizer.json"))
    kinds = set()
    with httpx.Client(base_url=openai_api[0].removesuffix("/v1"), timeout=120) as c:
        for r in data["requests"]:
            body = dict(r["body"], model=openai_api[1])
            resp = c.post(r["path"], json=body)
            assert resp.status_code == r["status"] == 200, resp.text
            out = resp.json()["choices"][0]
            ids = body["prompt"][0]
            if body.get("echo"):  # loglikelihood: what lm-eval's parse_logprobs reads
                kinds.add("loglikelihood")
                lp = out["logprobs"]
                chosen, top_ids, top_lp = scorer(ids)
                assert lp["token_logprobs"] == [None] + chosen + [top_lp[-1]]
                assert [None if t is None else list(t.values()) for t in lp["top_logprobs"]] == \
                    [None] + [[v] for v in top_lp]
                assert [None if t is None else list(t) for t in lp["top_logprobs"]][1:] == \
                    [[tok.decode([t], skip_special_tokens=False)] for t in top_ids]
                assert lp["tokens"][:-1] == [tok.decode([t], skip_special_tokens=False) for t in ids]
            else:  # generate_until: token ids in, greedy text cut at the first stop string out
                kinds.add("generate_until")
                text = generate_http(tiny_server.urls()["http"], tok.decode(ids, skip_special_tokens=False),
                                     body["max_tokens"], top_k=1, exclude_input_in_output=True)
                cut = min([text.index(s) for s in body["stop"] if s in text] + [len(text)])
                assert out["text"] == text[:cut]
    assert kinds == {"loglikelihood", "generate_until"}


@pytest.mark.integration
def test_the_issues_stop_request_ends_at_the_stop(client, openai_api) -> None:
    """Issue 24's request: non-streaming with stop "\\n" used to generate all 400 tokens."""
    t0 = time.perf_counter()
    out = client.completions.create(model=openai_api[1], prompt="def fibonacci(n):", max_tokens=400, temperature=0,
                                    stop="\n")
    took = time.perf_counter() - t0
    streamed = list(client.completions.create(model=openai_api[1], prompt="def fibonacci(n):", max_tokens=400,
                                              temperature=0, stop="\n", stream=True,
                                              stream_options={"include_usage": True}))
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens <= 5, (out.usage, took)
    assert out.usage.completion_tokens == streamed[-1].usage.completion_tokens
    assert out.choices[0].text == "".join(c.choices[0].text for c in streamed if c.choices)


@pytest.mark.integration
def test_logprobs_per_token_equal_streamed_or_not(client, openai_api) -> None:
    kw = dict(model=openai_api[1], prompt="import os\nimport", max_tokens=12, temperature=0, logprobs=0)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices]
    tokens = [t for lp in chunks if lp for t in lp.tokens]
    offsets = [o for lp in chunks if lp for o in lp.text_offset]
    values = [v for lp in chunks if lp for v in lp.token_logprobs]
    assert whole.tokens == tokens and whole.text_offset == offsets and whole.token_logprobs == values
    assert all(whole.tokens) and len(set(whole.text_offset)) == len(whole.text_offset), "text per token"


@pytest.mark.integration
def test_the_reference_runtime_honours_end_id_minus_one_and_min_tokens(tiny_server, tiny_build) -> None:
    """ignore_eos is sent as end_id -1 and min_tokens as min_tokens (unit-tested in test_openai_inprocess); the
    tiny model never emits its own end token in reach, so the end id here is the newline it generates first."""
    from tokenizers import Tokenizer

    from kiln.serve.client import generate_stream

    tok = Tokenizer.from_file(str(tiny_build[2] / "preprocessing" / "1" / "tokenizer" / "tokenizer.json"))
    newline = tok.encode("\n", add_special_tokens=False).ids[-1]

    def gen(**fields) -> str:
        return "".join(generate_stream(tiny_server.urls()["grpc"], "import os", 6, top_k=1, **fields))

    free = gen()
    assert free.startswith("\n") and len(tok.encode(free, add_special_tokens=False).ids) == 6
    assert gen(end_id=newline) == "", "the newline ends the generation"
    assert gen(end_id=-1) == free, "end_id -1: no token ends it"
    held = gen(end_id=newline, min_tokens=6)
    assert not held.startswith("\n") and len(tok.encode(held, add_special_tokens=False).ids) == 6, \
        "min_tokens holds the end token back"


@pytest.fixture(scope="module")
def client(openai_api):
    openai = pytest.importorskip("openai", reason="the official SDK: pip install kiln[dev]")
    return openai.OpenAI(base_url=openai_api[0], api_key="unused", max_retries=0, timeout=120)


@pytest.mark.integration
def test_guidellm_requests_replayed_get_every_token_they_ask_for(openai_api) -> None:
    """guidellm 0.8.1 streams chat with content parts, ignore_eos and max_completion_tokens, and counts the
    server's usage: each replayed request answers 200 and reports exactly max_completion_tokens."""
    import httpx

    data = recording("guidellm")
    posts = [r for r in data["requests"] if r["method"] == "POST"]
    assert posts and all(r["body"].get("ignore_eos") for r in posts)
    with httpx.Client(base_url=openai_api[0].removesuffix("/v1"), timeout=120) as c:
        for r in data["requests"]:
            body = dict(r["body"], model=openai_api[1]) if r["body"] else None
            resp = c.request(r["method"], r["path"], json=body)
            assert resp.status_code == r["status"] == 200, resp.text
            if r["method"] != "POST":
                continue
            events = [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            assert usage["completion_tokens"] == body["max_completion_tokens"], usage


@pytest.mark.integration
def test_aiperf_requests_replayed_stream_what_aiperf_parses_with_every_token_asked(openai_api, tiny_server) -> None:
    """AIPerf 0.13 (``profile --endpoint-type chat --streaming``, its fixed-length extensions ``ignore_eos:true``
    and ``min_tokens`` via ``--extra-inputs``) probes ``/metrics`` for Prometheus server metrics (kiln's OpenAI port
    answers 404; AIPerf then runs without them) and streams chat with ``max_completion_tokens`` and
    ``stream_options.include_usage``. What it parses (aiperf/endpoints/openai_chat.py): ``object``
    ``chat.completion.chunk``, ``choices[0].delta.content``, and ``usage`` from whichever event carries it. Each
    replayed request answers the recorded status; each stream is chunks, then one usage event (no choices) with
    exactly the asked tokens, then ``[DONE]``; and the requests kiln builds for the served model carry
    ``end_id -1`` and ``min_tokens`` (test_the_reference_runtime_honours_end_id_minus_one_and_min_tokens shows the
    runtime honours them; the tiny model never ends on its own within 8 tokens, so the count alone cannot)."""
    import asyncio
    import struct

    import httpx

    from kiln.serve.openai.backend import TritonBackend
    from kiln.serve.openai.protocol import parse_request

    data = recording("aiperf")
    posts = [r for r in data["requests"] if r["method"] == "POST"]
    assert len(posts) == 6 and all(r["body"]["ignore_eos"] is True and r["body"]["stream"] is True
                                   and r["body"]["min_tokens"] == r["body"]["max_completion_tokens"] for r in posts)
    with httpx.Client(base_url=openai_api[0].removesuffix("/v1"), timeout=120) as c:
        for r in data["requests"]:
            body = dict(r["body"], model=openai_api[1]) if r["body"] else None
            resp = c.request(r["method"], r["path"], json=body)
            assert resp.status_code == r["status"], (r["method"], r["path"], resp.text)
            if r["method"] != "POST":
                continue
            events = [line[6:] for line in resp.text.split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            assert [ch.get("usage") is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]
            assert chunks[-1]["choices"] == []
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == body["max_completion_tokens"] and usage["prompt_tokens"] > 0 and \
                usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
            assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks[:-1])
            assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]][-1] == "length"

    async def contract():
        backend = TritonBackend(tiny_server.urls()["grpc"])
        await backend.open()
        try:
            return backend, await backend.contract()
        finally:
            await backend.close()

    backend, served = asyncio.run(contract())
    for r in posts:
        req = parse_request(json.dumps(r["body"]).encode(), chat=True)
        msg = backend._request(req, "x", req.max_tokens, served)
        sent = {t.name: raw for t, raw in zip(msg.inputs, msg.raw_input_contents)}
        assert sent.get("end_id") == struct.pack("<i", -1), "ignore_eos: end_id -1, no token ends the generation"
        assert sent.get("min_tokens") == struct.pack("<i", r["body"]["min_tokens"]), "min_tokens"
