"""kiln's CPU ``tensorrt_llm`` model for the ``reference`` target (a test and development vehicle, not the fast
path), exercised in process with the stand-in for ``triton_python_backend_utils`` (see triton_harness).

The pure parts (sampling rules, word lists, sequences, settings) are fast; the runtime tests run a real tiny
quantized Llama (ModelOpt INT8 SmoothQuant, saved with ``mto.save``) under transformers' continuous batching,
so they are marked ``integration``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from triton_harness import (  # noqa: F401 - fixtures are used by name
    FINAL,
    error_of,
    generated,
    hf_greedy,
    hf_model,
    llm,
    llm_request,
    make_seq,
    model_args,
    pb_utils,
    ref,
    start_reference,
    streamed,
    tiny_model,
    tok_of,
    tokenizer,
    tokenizer_dir,
)


# ============================================================================ reference (tensorrt_llm): pure parts
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "greedy"),
    [
        (None, None, None, True),  # TensorRT-LLM: top_k = top_p = 0 means greedy
        (0.7, None, None, True),
        (1.0, 1, 0.9, True),  # top_k = 1
        (0.0, 50, 0.9, True),  # temperature 0
        (None, 40, None, False),
        (0.8, 0, 0.9, False),
        (1.0, 0, 1.0, False),  # top_p = 1: sample from the whole distribution
    ],
)
def test_greedy_or_sampled_follows_tensorrt_llm(
    ref: Any, temperature: float | None, top_k: int | None, top_p: float | None, greedy: bool
) -> None:
    assert ref.make_sampling(temperature, top_k, top_p).greedy is greedy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_values_are_request_errors(ref: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ref.RequestError, match=message):
        ref.make_sampling(**kwargs)


def _draws(ref: Any, logits: list[float], n: int = 400, **kwargs: Any) -> list[int]:
    import torch

    spec = ref.make_sampling(**kwargs)
    out = []
    for _ in range(n):
        row = torch.tensor(logits)
        ref.process_row(row, spec, [0])
        out.append(int(torch.argmax(row)))
    return out


def test_sampling_respects_top_k_top_p_and_seed(ref: Any) -> None:
    logits = [2.0, 1.9, 1.8, 0.5, 0.0, -1.0]
    assert set(_draws(ref, logits, top_k=2, seed=1)) == {0, 1}, "top_k=2 draws only the two best"
    assert set(_draws(ref, logits, top_k=0, top_p=1.0, temperature=5.0, seed=1)) == set(range(6))
    assert set(_draws(ref, logits, top_p=0.01, seed=1)) == {0}, "a tiny top_p keeps only the best token"
    assert _draws(ref, logits, 50, top_k=6, seed=7) == _draws(ref, logits, 50, top_k=6, seed=7)
    assert _draws(ref, logits, 50, top_k=6, seed=7) != _draws(ref, logits, 50, top_k=6, seed=8)
    counts = np.bincount(_draws(ref, [0.0, float(np.log(3.0))], 3000, top_k=2, seed=3), minlength=2)
    assert abs(counts[1] / counts.sum() - 0.75) < 0.04, f"draws follow softmax(logits): {counts}"


def test_process_row_masks_bad_words_and_end_id_before_min_tokens(ref: Any) -> None:
    import torch

    spec = ref.make_sampling(bad_words=[[3], [5, 2]], min_tokens=2, end_id=4, prompt_len=2, want_logprobs=True)
    row = torch.tensor([0.0, 0.0, 9.0, 8.0, 10.0, 1.0])
    ref.process_row(row, spec, [7, 5, 6])  # context ends with 6: bad word [5, 2] not armed; 1 token generated
    assert int(torch.argmax(row)) == 2 and row[3] == -float("inf") and row[4] == -float("inf")
    row = torch.tensor([0.0, 0.0, 9.0, 8.0, 10.0, 1.0])
    ref.process_row(row, spec, [7, 5, 6, 5])  # ends with 5: [5, 2] armed; 2 generated: end id allowed
    assert int(torch.argmax(row)) == 4 and row[2] == -float("inf")
    assert len(spec.logprobs) == 2 and all(lp <= 0 for lp in spec.logprobs)


def test_word_lists_parse_upstream_layout(ref: Any) -> None:
    arr = np.array([[[5, 6, 7, 0], [2, 3, -1, -1]], [[9, 0, 0, 0], [1, -1, -1, -1]]], dtype=np.int32)
    assert ref.word_lists(arr, 2) == [[[5, 6], [7]], [[9]]]
    assert ref.word_lists(np.zeros((1, 2, 0), np.int32), 1) == [[]]
    with pytest.raises(ref.RequestError, match="offsets"):
        ref.word_lists(np.array([[[5, 6], [3, -1]]], dtype=np.int32), 1)


def test_sequence_drops_end_id_and_stops_after_stop_words(ref: Any) -> None:
    seq = make_seq(ref, stop_words=[[7, 8]])
    assert not seq.update([5, 7], finished=False) and seq.tokens == [5, 7]
    assert seq.update([5, 7, 8, 9], finished=False) and seq.tokens == [5, 7, 8], "stop word kept, rest cut"
    seq = make_seq(ref)
    assert seq.update([5, 6, 1], finished=True) and seq.tokens == [5, 6], "the end id is not output"


def test_sequence_verifies_draft_tokens(ref: Any) -> None:
    seq = make_seq(ref, draft=[4, 5, 6])
    assert not seq.update([4, 5], finished=False)
    assert seq.update([4, 5, 9], finished=False) and seq.tokens == [4, 5, 9], "accepted + the target's own token"
    seq = make_seq(ref, draft=[4, 5])
    assert seq.update([4, 5, 6], finished=True) and seq.tokens == [4, 5, 6], "all accepted + one bonus token"


def test_cancellation_poll_and_sends_exclude_each_other(ref: Any) -> None:
    """The lock discipline of the llmapi model (commit 0f275ca): is_cancelled() is asked only under the lock that
    every response send takes, and never of a request that has sent its final response (a released request's
    is_cancelled() crashed tritonserver there)."""
    from triton_harness import FakeRequest

    model = ref.TritonPythonModel.__new__(ref.TritonPythonModel)
    model._lock, model._jobs, model._by_rid = ref.threading.RLock(), {}, {}
    model.sampler = ref.KilnSampler()
    cancelled_in_manager: list[str] = []
    model.mgr = type("Mgr", (), {"cancel_request": lambda self, rid: cancelled_in_manager.append(rid)})()
    asked: list[tuple[str, bool]] = []

    def job(name: str, cancelled: bool, finished: bool = False) -> Any:
        request = FakeRequest({})
        request.is_cancelled = lambda: asked.append((name, model._lock._is_owned())) or cancelled
        request.sender.send = (lambda send: lambda *a, **k: (asked.append((f"send {name}", model._lock._is_owned())),
                                                            send(*a, **k)))(request.sender.send)
        j = ref.Job(request, request.sender, False, True, False, [make_seq(ref)], finished=finished)
        j.seqs[0].rid = name
        model._jobs[id(j)] = j
        return j

    running, gone, done = job("running", False), job("gone", True), job("done", True, finished=True)
    model._check_cancelled()
    assert ("done", True) not in asked and ("done", False) not in asked, "a finished request is never asked"
    assert all(owned for _, owned in asked), f"asked or sent outside the lock: {asked}"
    assert ("gone", True) in asked and ("send gone", True) in asked and cancelled_in_manager == ["gone"]
    assert gone.finished and not running.finished and id(gone) not in model._jobs
    model._send_job(gone, None)  # a late non-final send for a finished job is dropped, not sent
    assert [f for _, f in gone.sender.sent] == [FINAL]


def test_reference_settings_map_parameters(ref: Any, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "modelopt_state.pth").write_bytes(b"")
    cfg = json.loads(model_args({
        "model_dir": tmp_path, "tokens_per_block": 16, "max_tokens_in_paged_kv_cache": 100, "max_num_tokens": 512,
        "enable_kv_cache_reuse": "false", "num_threads": 3,
    }, {"output_ids": "TYPE_INT32"}, decoupled=True)["model_config"])
    s = ref.read_settings(cfg)
    assert (s.tokens_per_block, s.num_blocks, s.max_num_tokens, s.kv_cache_reuse) == (16, 7, 512, False)
    assert (s.max_batch_size, s.num_threads, s.decoupled) == (8, 3, True)
    assert s.state_file == str(tmp_path / "modelopt_state.pth")
    (tmp_path / "modelopt_state.pth").unlink()
    with pytest.raises(ValueError, match="mto|modelopt"):
        ref.read_settings(cfg)
    cfg["parameters"]["modelopt_state"] = {"string_value": "none"}
    assert ref.read_settings(cfg).state_file is None, "'none' serves the unquantized model"
    cfg["parameters"]["tokens_per_block"] = {"string_value": "two"}
    with pytest.raises(ValueError, match="tokens_per_block"):
        ref.read_settings(cfg)


# ============================================================================ reference (tensorrt_llm): the runtime
PROMPT_TEXTS = ["The quick brown fox", "Zürich café", "Beautiful is better than ugly. Explicit"]


@pytest.mark.integration
def test_reference_greedy_equals_hf_generate_with_requests_in_flight(
    llm: Any, hf_model: Any, tokenizer: Any
) -> None:
    prompts = [tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    lengths = [20, 33, 7]
    requests = [llm_request([p], n, exclude_input_in_output=True) for p, n in zip(prompts, lengths)]
    llm.execute(requests)  # all three join the running batch; none is waited for
    for request, prompt, n in zip(requests, prompts, lengths):
        [resp] = request.sender.wait()
        assert not resp.has_error(), resp.error() and resp.error().message()
        assert generated(resp) == [hf_greedy(hf_model, prompt, n)]
    batch = llm_request(prompts, 12, exclude_input_in_output=True)  # one Triton request, three sequences
    llm.execute([batch])
    by_item = per_batch_item(batch.sender)
    assert by_item == {i: hf_greedy(hf_model, p, 12) for i, p in enumerate(prompts)}


def per_batch_item(sender: Any) -> dict[int, list[int]]:
    """Upstream's answer to a request of batch > 1 (inflight_batcher_llm/src/model_instance_state.cc at c2e65b8,
    fillTritonResponse and WaitForResponse): each item's responses on their own (output_ids [1, beams, L],
    sequence_length [1, beams]) with ``batch_index`` [[i]]; an item's last response carries the final flag only
    when it is the last item to end. Returns each item's tokens, concatenated over its responses."""
    sender.wait()
    tokens: dict[int, list[int]] = {}
    for n, (resp, flags) in enumerate(sender.sent):
        last = n == len(sender.sent) - 1
        assert bool(flags & FINAL) == last, "one final flag, on the last response sent"
        if resp is None:
            continue
        assert not resp.has_error(), resp.error() and resp.error().message()
        ids, index = resp.get("output_ids"), resp.get("batch_index")
        assert ids.shape[:2] == (1, 1) and resp.get("sequence_length").shape == (1, 1), "one item per response"
        assert index is not None and index.shape == (1, 1) and index.dtype == np.int32
        tokens.setdefault(int(index[0, 0]), []).extend(generated(resp)[0])
    return tokens


@pytest.mark.integration
def test_reference_batch_items_stream_on_their_own_with_batch_index(llm: Any, hf_model: Any, tokenizer: Any) -> None:
    prompts = [tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    batch = llm_request(prompts, 10, exclude_input_in_output=True, streaming=True)
    llm.execute([batch])
    assert per_batch_item(batch.sender) == {i: hf_greedy(hf_model, p, 10) for i, p in enumerate(prompts)}
    one = llm_request(prompts[:1], 4, exclude_input_in_output=True, streaming=True)
    llm.execute([one])
    assert all(r.get("batch_index") is None for r in one.sender.wait()), "batch 1: no batch_index, as upstream"


@pytest.mark.integration
def test_reference_batches_in_flight(llm: Any) -> None:
    """A short request sent after a long one finishes first: it joined the running batch, it did not queue."""
    long = llm_request([[0, 5, 6]], 120, streaming=True, end_id=-1)  # end_id -1: never stop early
    short = llm_request([[0, 7, 8]], 4, streaming=True)
    llm.execute([long])
    deadline = time.monotonic() + 60
    while not long.sender.sent and time.monotonic() < deadline:
        time.sleep(0.005)
    llm.execute([short])
    short.sender.wait()
    long.sender.wait()
    assert short.sender.sent_at[-1] < long.sender.sent_at[-1]
    assert sum(len(c) for c in streamed(long.sender.wait())) == 120


def test_streamed_chunks_wait_for_whole_characters(ref: Any, tokenizer_dir: Path) -> None:
    """_releasable holds back a chunk whose text ends inside a UTF-8 character, and lets it go once complete."""
    tok = tok_of(tokenizer_dir)
    ids = tok.encode("a東", add_special_tokens=False).ids
    assert tok.decode(ids[:-1]).endswith(ref.REPLACEMENT), "'東' spans several byte-level tokens"
    model = ref.TritonPythonModel.__new__(ref.TritonPythonModel)
    model.tokenizer = tok
    seq = make_seq(ref)
    seq.update(ids[:-1], finished=False)
    assert model._releasable(seq) == 0
    seq.update(ids, finished=False)
    assert model._releasable(seq) == len(ids)
    model.tokenizer = None
    assert model._releasable(seq) == len(ids), "without a tokenizer every token goes out at once"


@pytest.mark.integration
def test_reference_streams_new_tokens_without_splitting_characters(llm: Any, hf_model: Any, tokenizer: Any) -> None:
    prompt = tokenizer.encode("東京 😀 café").ids
    request = llm_request([prompt], 40, streaming=True)
    llm.execute([request])
    chunks = streamed(request.sender.wait())
    expected = hf_greedy(hf_model, prompt, 40)
    assert [t for c in chunks for t in c] == expected, "streaming sends only new tokens, all of them, in order"
    assert len(chunks) > 1
    text = "".join(tokenizer.decode(c) for c in chunks)
    assert text == tokenizer.decode(expected), "chunks decode on their own to the whole text"
    assert request.sender.sent[-1][1] == FINAL


@pytest.mark.integration
def test_reference_non_decoupled_returns_prompt_and_output(ref: Any, tiny_model: Path, hf_model: Any) -> None:
    model = start_reference(ref, tiny_model, decoupled=False)
    try:
        prompt = [0, 17, 45, 99]
        request = llm_request([prompt], 9)
        model.execute([request])
        [resp] = request.sender.wait()
        assert generated(resp) == [prompt + hf_greedy(hf_model, prompt, 9)], "exclude_input_in_output defaults false"
        stream = llm_request([prompt], 4, streaming=True)
        model.execute([stream])
        assert "decoupled" in error_of(stream.sender.wait()[0])
        batch = llm_request([prompt, prompt], 4)  # upstream's backend refuses it too (its utils.cc)
        model.execute([batch])
        assert "Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy" in \
            error_of(batch.sender.wait()[0])
    finally:
        model.finalize()
    assert not model.mgr.is_running(), "finalize() stops the manager's (non-daemon) thread"


@pytest.mark.integration
def test_reference_seeded_sampling_is_reproducible_whatever_runs_beside_it(llm: Any) -> None:
    prompt = [0, 20, 30, 40]

    def sample(seed: int, with_neighbour: bool) -> list[int]:
        sampled = dict(runtime_top_k=50, temperature=1.5, seed=np.uint64(seed), exclude_input_in_output=True)
        reqs = [llm_request([prompt], 24, **sampled)]
        if with_neighbour:
            reqs.append(llm_request([[0, 9, 9, 9, 9]], 30, exclude_input_in_output=True))
        llm.execute(reqs)
        out = generated(reqs[0].sender.wait()[0])[0]
        for r in reqs[1:]:
            r.sender.wait()
        return out

    first = sample(123, with_neighbour=False)
    assert sample(123, with_neighbour=True) == first
    assert sample(124, with_neighbour=False) != first
    greedy = llm_request([prompt], 24, exclude_input_in_output=True)
    llm.execute([greedy])
    assert generated(greedy.sender.wait()[0])[0] != first, "runtime_top_k=50 at temperature 1.5 does sample"


@pytest.mark.integration
def test_reference_stops_at_stop_words_and_reports_log_probs(llm: Any, hf_model: Any) -> None:
    import torch

    prompt = [0, 11, 12, 13]
    expected = hf_greedy(hf_model, prompt, 20)
    stop = np.array([[expected[4:6], [2, -1]]], dtype=np.int32)
    request = llm_request([prompt], 20, exclude_input_in_output=True, stop_words_list=stop, return_log_probs=True)
    llm.execute([request])
    [resp] = request.sender.wait()
    assert generated(resp) == [expected[:6]]
    out = model_out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
        eos_token_id=1, pad_token_id=1,
    )
    hf_lp = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, model_out.sequences[0, len(prompt) :])]
    assert np.allclose(resp.get("output_log_probs")[0, 0, :6], hf_lp, atol=1e-4)
    assert np.isclose(resp.get("cum_log_probs")[0, 0], sum(hf_lp), atol=1e-3)


@pytest.mark.integration
def test_reference_cancellation_frees_the_request(llm: Any) -> None:
    request = llm_request([[0, 5, 6]], 400, streaming=True, end_id=-1)  # only cancellation can stop it early
    llm.execute([request])
    deadline = time.monotonic() + 60
    while not request.sender.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    request.sender.cancelled = True
    responses = request.sender.wait(timeout=30)
    assert sum(len(c) for c in streamed(responses)) < 400
    deadline = time.monotonic() + 10
    while llm.mgr.batch_processor.scheduler.active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.mgr.batch_processor.scheduler.active_requests, "the manager dropped the cancelled request"
    assert not llm._by_rid and not llm._jobs


@pytest.mark.integration
@pytest.mark.parametrize(
    ("extra", "max_new", "message"),
    [
        ({"beam_width": 2}, 4, "beam_width=2 is not supported by the reference target"),
        ({"return_context_logits": True}, 4, "context logits are not produced by the reference target"),
        ({"return_generation_logits": True}, 4, "generation logits are not produced by the reference target"),
        ({"lora_task_id": np.uint64(3)}, 4, "LoRA adapters are not supported by the reference target"),
        ({"guided_decoding_guide": np.array([[b"{}"]], dtype=np.object_)}, 4, "guided decoding is not supported"),
        ({"prompt_embedding_table": np.ones((1, 2, 4), np.float16)}, 4, "prompt tuning"),
        ({"draft_logits": np.ones((1, 2, 4), np.float32)}, 4, "draft logits"),
        ({"repetition_penalty": np.float32(1.3)}, 4, "repetition_penalty"),
        ({}, 5000, "needs 5003 KV-cache tokens, but the cache holds 1024"),
        ({}, 0, "request_output_len must be at least 1"),
        ({"stop_words_list": np.array([[[5, 6], [3, -1]]], dtype=np.int32)}, 4, "offsets"),
    ],
)
def test_reference_refuses_bad_requests_and_keeps_serving(
    llm: Any, extra: dict[str, Any], max_new: int, message: str
) -> None:
    bad = llm_request([[0, 5, 6]], max_new, **extra)
    good = llm_request([[0, 5, 6]], 3)
    llm.execute([bad, good])
    assert message in error_of(bad.sender.wait()[0])
    assert bad.sender.sent[-1][1] == FINAL
    assert len(generated(good.sender.wait()[0])[0]) == 3 + 3


@pytest.mark.integration
def test_reference_refuses_token_ids_outside_the_vocabulary(llm: Any) -> None:
    """An out-of-range id would crash the manager's step (and every request in it): refused up front."""
    bad = llm_request([[0, 5, 100_000]], 4)
    bad_words = llm_request([[0, 5]], 4, bad_words_list=np.array([[[-7], [1]]], dtype=np.int32))
    good = llm_request([[0, 5, 6]], 3)
    llm.execute([bad, bad_words, good])
    assert "input_ids holds token ids outside the vocabulary" in error_of(bad.sender.wait()[0])
    assert "bad_words_list holds token ids outside" in error_of(bad_words.sender.wait()[0])
    assert len(generated(good.sender.wait()[0])[0]) == 3 + 3
    assert llm.mgr.is_running()




@pytest.mark.integration
def test_reference_accepts_inputs_it_ignores_as_tensorrt_llm_does(llm: Any) -> None:
    """What upstream's clients send to a decoder-only model: the decoder inputs (ignored, as the backend does),
    neutral settings of features it lacks, and the logits flags set to false."""
    plain = llm_request([[0, 5, 6]], 5)
    extras = llm_request([[0, 5, 6]], 5, decoder_input_ids=np.array([[1]], np.int32), decoder_input_lengths=1,
                         return_context_logits=False, return_generation_logits=False, runtime_top_p_decay=np.float32(1),
                         prompt_table_extra_ids=np.zeros((1, 3), np.uint64), early_stopping=True, len_penalty=np.float32(1))
    llm.execute([plain, extras])
    assert generated(extras.sender.wait()[0]) == generated(plain.sender.wait()[0])


@pytest.mark.integration
def test_reference_token_counts_and_embedding_bias(llm: Any) -> None:
    want = {"return_num_input_tokens": True, "return_num_output_tokens": True}
    whole = llm_request([[0, 5, 6, 7]], 6, exclude_input_in_output=True, **want)
    stream = llm_request([[0, 5, 6, 7]], 6, streaming=True, **want)
    bias = np.zeros((1, 64), np.float32)
    bias[0, 42] = 1e4  # outweighs any logit: greedy picks token 42 every step
    biased = llm_request([[0, 5, 6]], 4, exclude_input_in_output=True, embedding_bias=bias)
    llm.execute([whole, stream, biased])
    [resp] = whole.sender.wait()
    assert resp.get("num_input_tokens").tolist() == [[4]] and resp.get("num_output_tokens").tolist() == [[6]]
    parts = stream.sender.wait()
    assert sum(int(r.get("num_output_tokens")[0, 0]) for r in parts) == 6, "streaming: each response's new tokens"
    assert all(r.get("num_input_tokens").tolist() == [[4]] for r in parts)
    assert generated(biased.sender.wait()[0]) == [[42, 42, 42, 42]]
