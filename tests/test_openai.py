"""kiln's OpenAI-compatible server (kiln.serve.openai): request validation, stop sequences and chat templates in
process; then the official ``openai`` SDK against the app in front of a real tritonserver serving the default
recipe (shared with the other integration modules): streamed and whole chat and completions, greedy text equal
to the Triton ensemble's, usage and log-probs, OpenAI-shaped errors after which it keeps serving, 64 concurrent
streams, and a client that goes away cancelling the Triton request."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from kiln.serve.openai.chat import ChatTemplateError, load_chat_template
from kiln.serve.openai.protocol import APIError, parse_request

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "src" / "kiln" / "models" / "data"


# ============================================================================ requests, in process
def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


@pytest.mark.parametrize(("fields", "param", "needle"), [
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"temperature": 3}, "temperature", "between 0 and 2"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"logprobs": 2}, "logprobs", "only the top-1 alternative"),
    ({"logprobs": 1}, "logprobs", "served with echo"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"echo": True, "max_tokens": 2}, "max_tokens", "max_tokens 0 or 1"),
    ({"echo": True, "max_tokens": 1, "temperature": 0.5}, "temperature", "greedy token"),
    ({"echo": True, "max_tokens": 0, "stream": True}, "stream", "not served streamed"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "one prompt per request"),
    ({"prompt": [1, "a"]}, "prompt", "list of token ids"),
    ({"suffix": "x"}, "suffix", "suffix is not supported"),
    ({"wizardry": 1, "zz": 2}, "wizardry", "Unrecognized request argument supplied: wizardry, zz"),
    ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
    ({"min_tokens": -1}, "min_tokens", "at least 0"),
    ({"presence_penalty": 0.5}, "presence_penalty", "only 0"),
    ({"model": ""}, "model", "model is required"),
])
def test_bad_requests_name_the_parameter(fields: dict, param: str, needle: str) -> None:
    with pytest.raises(APIError) as info:
        parse_request(body(**fields), chat=False)
    assert info.value.status == 400 and info.value.param == param and needle in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_token_id_prompts_echo_and_extensions_parse() -> None:
    assert parse_request(body(prompt=[1, 100, 200]), chat=False).prompt_ids == [1, 100, 200]
    assert parse_request(body(prompt=[[1, 100]]), chat=False).prompt_ids == [1, 100]
    req = parse_request(body(echo=True, max_tokens=0, logprobs=1, temperature=0, ignore_eos=True, min_tokens=3),
                        chat=False)
    assert (req.echo, req.max_tokens, req.logprobs, req.top_logprobs) == (True, 0, True, 1)
    assert req.ignore_eos and req.min_tokens == 3 and "min_tokens" in req.explicit
    with pytest.raises(APIError, match="not a role") as info:
        parse_request(json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(), chat=True)
    assert info.value.param == "messages[0].role"
    with pytest.raises(APIError, match="Unrecognized request argument supplied: echo"):
        parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}).encode(),
                      chat=True)


def test_chat_request_defaults_and_refusals() -> None:
    req = parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode(), chat=True)
    assert req.messages == [{"role": "user", "content": "ab"}] and req.max_tokens is None
    assert req.temperature == 1.0 and req.top_p == 1.0 and not req.greedy, "OpenAI's defaults: sampling"
    with pytest.raises(APIError, match="top_logprobs is not supported"):
        parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                  "logprobs": True, "top_logprobs": 3}).encode(), chat=True)
    with pytest.raises(APIError, match="only text parts"):
        parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), chat=True)
    with pytest.raises(APIError, match="not valid JSON"):
        parse_request(b"{nope", chat=True)


def test_stop_sequences_are_cut_and_their_starts_held_back() -> None:
    from kiln.serve.openai.app import StopCutter

    cut = StopCutter(["\n\n", "END"])
    assert cut.feed("abc\n") == "abc", "a newline may start a stop sequence: held back"
    assert cut.feed("x E") == "\nx ", "not one after all; 'E' may start END"
    assert cut.feed("NDtail") == "" and cut.stopped
    assert StopCutter([]).feed("a\n\n") == "a\n\n"
    other = StopCutter(["END"])
    assert other.feed("aE") == "a" and other.flush() == "E", "the end of the output releases what was held"


def test_chat_template_loading(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None and load_chat_template(None) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                                                "[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}"}]}))
    t = load_chat_template(tmp_path)
    assert t is not None and t.render([{"role": "user", "content": "é"}]) == '<s>[user]"é"'
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('system messages only') }}")
    with pytest.raises(ChatTemplateError, match="system messages only"):
        load_chat_template(tmp_path).render([])


def test_tiny_llama_ships_a_chat_template(tmp_path: Path) -> None:
    from kiln.models.tiny import TINY_LLAMA, builtin_chat_template

    source = builtin_chat_template(TINY_LLAMA)
    assert source is not None and builtin_chat_template("hf:org/model") is None
    (tmp_path / "chat_template.jinja").write_text(source)
    text = load_chat_template(tmp_path).render([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Sum a list\nquickly"}])
    assert text == "# system:\n# Be brief.\n# user:\n# Sum a list\n# quickly\n# assistant:\n"
    assert "<s>" not in text, "no BOS: preprocessing adds it"


# ============================================================================ the SDK against the served default recipe
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def api(openai_api):
    """kiln's OpenAI server in front of the session's tritonserver (conftest's, shared); (base_url, model name)."""
    return openai_api


@pytest.fixture(scope="module")
def client(api):
    openai = pytest.importorskip("openai", reason="the official SDK: pip install kiln[dev]")
    return openai.OpenAI(base_url=api[0], api_key="unused", max_retries=0, timeout=120)


def ensemble_text(server, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    from kiln.serve.client import generate_http

    return generate_http(server.urls()["http"], prompt, max_tokens, top_k=1, exclude_input_in_output=True)


@pytest.mark.integration
def test_models_lists_the_recipe(client, api) -> None:
    assert [m.id for m in client.models.list().data] == [api[1]]
    assert client.models.retrieve(api[1]).owned_by == "kiln"


@pytest.mark.integration
def test_completions_greedy_equal_the_ensemble_streamed_or_not(client, api, tiny_server, tiny_greedy) -> None:
    prompt = "def fibonacci(n):"
    expected = ensemble_text(tiny_server, prompt)
    ids, gen, text = tiny_greedy(prompt, MAX_TOKENS)
    assert expected == text, "the ensemble's greedy text is Hugging Face's"
    out = client.completions.create(model=api[1], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(gen))
    assert out.choices[0].finish_reason == ("length" if len(gen) == MAX_TOKENS else "stop")
    chunks = list(client.completions.create(model=api[1], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected and len(chunks) > 3
    assert chunks[-1].usage.completion_tokens == len(gen) and chunks[-2].choices[0].finish_reason == out.choices[0].finish_reason


@pytest.mark.integration
def test_chat_uses_the_chat_template_and_equals_the_ensemble(client, api, tiny_server, tiny_build) -> None:
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    template = load_chat_template(tiny_build[2] / "preprocessing" / "1" / "tokenizer")
    assert template is not None, "the package step wrote builtin:tiny-llama's chat template"
    expected = ensemble_text(tiny_server, template.render(messages))
    out = client.chat.completions.create(model=api[1], messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=True)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    lps = out.choices[0].logprobs.content
    assert len(lps) == out.usage.completion_tokens and all(t.logprob <= 0 for t in lps)
    assert "".join(t.token for t in lps) == expected, "each token's text, in order"
    stream = client.chat.completions.create(model=api[1], messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


@pytest.mark.integration
def test_stop_seed_and_sampling(client, api, tiny_server) -> None:
    prompt = "def fibonacci(n):"
    full = ensemble_text(tiny_server, prompt)
    stop = full[8:11]
    out = client.completions.create(model=api[1], prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=api[1], prompt=prompt, max_tokens=16, temperature=1.2, top_p=0.9,
                                      seed=7).choices[0].text for _ in range(2))
    assert a == b, "a seeded request samples the same tokens"


@pytest.mark.integration
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, api) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=api[1], prompt="hi", max_tokens=16, n=3)
    assert info.value.status_code == 400 and "n=3" in info.value.message
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_input_len"):  # the model's own refusal, passed on
        client.completions.create(model=api[1], prompt="word " * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="max_input_len"):
        client.completions.create(model=api[1], prompt="word " * 400, max_tokens=4, stream=True)
    assert client.completions.create(model=api[1], prompt="import os", max_tokens=4, temperature=0).choices[0].text


@pytest.mark.integration
def test_64_concurrent_streams_finish_without_errors(api, tiny_server) -> None:
    openai = pytest.importorskip("openai")
    prompts = ["import os\nimport", "class Config:", "for i in range(10):", "# Copyright"]
    expected = {p: ensemble_text(tiny_server, p, 8) for p in prompts}

    async def run() -> list:
        aclient = openai.AsyncOpenAI(base_url=api[0], api_key="unused", max_retries=0, timeout=300)

        async def one(i: int) -> str:
            stream = await aclient.completions.create(model=api[1], prompt=prompts[i % 4], max_tokens=8,
                                                      temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(64)), return_exceptions=True)
        finally:
            await aclient.close()

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == [expected[prompts[i % 4]] for i in range(64)]


@pytest.mark.integration
def test_a_client_that_goes_away_stops_the_triton_request(client, api, tiny_server) -> None:
    """Triton does not pass a cancelled ensemble request on to its running tensorrt_llm step, so the server also
    sends upstream's `stop` request for it; the model logs that it stopped (generating 400 tokens takes longer)."""
    stream = client.completions.create(model=api[1], prompt="The quick", max_tokens=400, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the HTTP connection goes away mid-stream

    def stopped() -> bool:
        return any("kiln-openai-" in line and "stopped by a stop request" in line
                   for line in tiny_server.log_tail(2000).splitlines())

    deadline = time.monotonic() + 15
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stopped()


def test_cli_serve_openai_flags(tmp_path: Path, kiln) -> None:
    """`kiln serve --openai` runs beside a local server only; `kiln openai --help` names the sidecar's options."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "kiln.json").write_text("{}")
    result = kiln("serve", repo, "--openai", "--docker")
    assert result.exit_code == 2 and "kiln openai --triton-url" in result.output
    result = kiln("openai", "--help")
    assert result.exit_code == 0 and "--triton-url" in result.output and "--repo" in result.output
