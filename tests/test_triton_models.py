"""kiln's tokenizer models (``preprocessing``, ``postprocessing``) and the helper module shipped beside every
Python model (``kiln_triton_utils``), exercised in process with the stand-in for ``triton_python_backend_utils``
(see triton_harness). Fast: no model, no ModelOpt. The reference runtime and the BLS model have their own
modules (test_triton_reference, test_triton_bls); test_server serves all of them on a real tritonserver.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from triton_harness import (  # noqa: F401 - fixtures are used by name
    MODELS_DIR,
    PRE_OUTPUTS,
    PRE_TEXT_OUTPUTS,
    FakeRequest,
    error_of,
    load_model_module,
    model_args,
    pb_utils,
    text_array,
    tok_of,
    tokenizer_dir,
)


# ============================================================================ preprocessing
@pytest.fixture
def preprocessing(pb_utils: Any, tokenizer_dir: Path) -> Any:
    module = load_model_module("preprocessing")
    model = module.TritonPythonModel()
    model.initialize(model_args({"tokenizer_dir": tokenizer_dir, "max_input_len": 24, "max_seq_len": 64}, PRE_OUTPUTS))
    return model


def test_preprocessing_tokenizes_and_pads_a_batch(preprocessing: Any, tokenizer_dir: Path) -> None:
    tok = tok_of(tokenizer_dir)
    texts = ["Zürich café", "The quick brown fox jumps"]
    [resp] = preprocessing.execute([FakeRequest({"QUERY": text_array(*texts), "REQUEST_OUTPUT_LEN": [[5], [7]]})])
    assert not resp.has_error()
    ids = [tok.encode(t).ids for t in texts]
    assert ids[0][0] == 0, "add_special_tokens defaults to true: the template adds <s>"
    input_ids, lengths = resp.get("INPUT_ID"), resp.get("REQUEST_INPUT_LEN")
    assert input_ids.dtype == np.int32 and lengths.tolist() == [[len(ids[0])], [len(ids[1])]]
    for row, expected in zip(input_ids, ids):
        assert row[: len(expected)].tolist() == expected
        assert set(row[len(expected) :].tolist()) <= {1}, "padding uses the pad id (= end id </s>)"
    assert resp.get("REQUEST_OUTPUT_LEN").tolist() == [[5], [7]]
    assert resp.get("OUT_END_ID").tolist() == [[1], [1]] and resp.get("OUT_PAD_ID").tolist() == [[1], [1]]
    assert resp.get("STOP_WORDS_IDS").shape == (2, 2, 0) and resp.get("BAD_WORDS_IDS").shape == (2, 2, 0)
    assert {t.name() for t in resp.output_tensors()} == PRE_TEXT_OUTPUTS, "upstream's outputs for a text request"
    # decoder-only: upstream's decoder outputs are one pad token of length 1; no embedding bias: [batch, 0]
    assert resp.get("DECODER_INPUT_ID").tolist() == [[1], [1]]
    assert resp.get("REQUEST_DECODER_INPUT_LEN").tolist() == [[1], [1]]
    assert resp.get("EMBEDDING_BIAS").shape == (2, 0) and resp.get("EMBEDDING_BIAS").dtype == np.float32


def test_preprocessing_encodes_a_decoder_query(preprocessing: Any, tokenizer_dir: Path) -> None:
    tok = tok_of(tokenizer_dir)
    request = FakeRequest({"QUERY": text_array("a"), "DECODER_QUERY": text_array("lazy dog"), "REQUEST_OUTPUT_LEN": [[3]]})
    [resp] = preprocessing.execute([request])
    ids = tok.encode("lazy dog").ids
    assert resp.get("DECODER_INPUT_ID").tolist() == [ids] and resp.get("REQUEST_DECODER_INPUT_LEN").tolist() == [[len(ids)]]


def test_preprocessing_embedding_bias_and_prompt_table_ids(preprocessing: Any, tokenizer_dir: Path) -> None:
    tok = tok_of(tokenizer_dir)
    words = np.array([[b"fox", b"dog"]], dtype=np.object_)
    weights = np.array([[2.0, -1.5]], dtype=np.float32)
    request = FakeRequest({"QUERY": text_array("a"), "REQUEST_OUTPUT_LEN": [[3]], "EMBEDDING_BIAS_WORDS": words,
                           "EMBEDDING_BIAS_WEIGHTS": weights, "PROMPT_TABLE_EXTRA_ID": np.array([[7]], np.uint64)})
    [resp] = preprocessing.execute([request])
    bias = resp.get("EMBEDDING_BIAS")
    assert bias.shape == (1, tok.get_vocab_size())
    expected = np.zeros(tok.get_vocab_size(), np.float32)
    for word, weight in (("fox", 2.0), ("dog", -1.5)):
        for t in tok.encode(word, add_special_tokens=False).ids:
            expected[t] += weight
    assert np.array_equal(bias[0], expected) and expected.any()
    extra = resp.get("OUT_PROMPT_TABLE_EXTRA_IDS")
    assert extra.dtype == np.uint64 and extra.shape == resp.get("INPUT_ID").shape and not extra.any(), (
        "no prompt-table positions (ids >= vocabulary) in a text prompt"
    )
    [bad] = preprocessing.execute([FakeRequest({"QUERY": text_array("a"), "REQUEST_OUTPUT_LEN": [[3]],
                                                "EMBEDDING_BIAS_WORDS": words})])
    assert "must be sent together" in error_of(bad)


@pytest.mark.parametrize("name", ["IMAGE_URL", "IMAGE_BYTES", "VIDEO_BYTES", "IMAGE_SIZES"])
def test_preprocessing_refuses_images_by_name(preprocessing: Any, name: str) -> None:
    value = np.array([[b"http://x/cat.png"]], dtype=np.object_) if name == "IMAGE_URL" else np.ones((1, 1, 2, 2, 3))
    [resp] = preprocessing.execute([FakeRequest({"QUERY": text_array("a"), "REQUEST_OUTPUT_LEN": [[3]], name: value})])
    message = error_of(resp)
    assert "not supported" in message and "text-only" in message and name in message


def test_preprocessing_honours_add_special_tokens_false(pb_utils: Any, tokenizer_dir: Path) -> None:
    model = load_model_module("preprocessing").TritonPythonModel()
    model.initialize(model_args({"tokenizer_dir": tokenizer_dir, "add_special_tokens": "false"}, PRE_OUTPUTS))
    [resp] = model.execute([FakeRequest({"QUERY": text_array("kiln"), "REQUEST_OUTPUT_LEN": [[4]]})])
    assert resp.get("INPUT_ID")[0].tolist() == tok_of(tokenizer_dir).encode("kiln", add_special_tokens=False).ids


def test_preprocessing_word_lists_use_upstream_layout(preprocessing: Any, tokenizer_dir: Path) -> None:
    tok = tok_of(tokenizer_dir)
    words = ["fox", " lazy dog", ""]
    request = FakeRequest({
        "QUERY": text_array("a", "b"), "REQUEST_OUTPUT_LEN": [[3], [3]],
        "STOP_WORDS_DICT": np.array([[w.encode() for w in words], [b"clay", b"", b""]], dtype=np.object_),
        "END_ID": [[7], [7]], "PAD_ID": [[9], [9]],
    })
    [resp] = preprocessing.execute([request])
    stop = resp.get("STOP_WORDS_IDS")
    a, b = (tok.encode(w, add_special_tokens=False).ids for w in ("fox", " lazy dog"))
    c = tok.encode("clay", add_special_tokens=False).ids
    width = len(a) + len(b)
    assert stop.shape == (2, 2, width)
    assert stop[0, 0].tolist() == a + b and stop[0, 1].tolist() == [len(a), len(a) + len(b)] + [-1] * (width - 2)
    assert stop[1, 0].tolist() == c + [0] * (width - len(c)) and stop[1, 1].tolist() == [len(c)] + [-1] * (width - 1)
    assert resp.get("OUT_END_ID").tolist() == [[7], [7]] and resp.get("OUT_PAD_ID").tolist() == [[9], [9]]


@pytest.mark.parametrize(
    ("text", "max_tokens", "message"),
    [
        ("", 8, "text_input is empty"),
        ("hello", 0, "max_tokens must be at least 1"),
        ("hello", -3, "max_tokens must be at least 1"),
        ("hello " * 40, 8, "max_input_len of 24"),
        ("hello", 63, "exceeds this model's max_seq_len of 64"),
    ],
)
def test_preprocessing_rejects_bad_requests_and_keeps_serving(
    preprocessing: Any, text: str, max_tokens: int, message: str
) -> None:
    bad = FakeRequest({"QUERY": text_array(text), "REQUEST_OUTPUT_LEN": [[max_tokens]]})
    good = FakeRequest({"QUERY": text_array("hello"), "REQUEST_OUTPUT_LEN": [[4]]})
    bad_resp, good_resp = preprocessing.execute([bad, good])
    assert message in error_of(bad_resp)
    assert not good_resp.has_error() and good_resp.get("INPUT_ID").size > 0


def test_preprocessing_refuses_absurd_max_tokens_without_limits(pb_utils: Any, tokenizer_dir: Path) -> None:
    model = load_model_module("preprocessing").TritonPythonModel()
    model.initialize(model_args({"tokenizer_dir": tokenizer_dir}, PRE_OUTPUTS))
    [resp] = model.execute([FakeRequest({"QUERY": text_array("hi"), "REQUEST_OUTPUT_LEN": [[2**30]]})])
    assert "is not served" in error_of(resp)


def test_preprocessing_config_errors_name_the_parameter(pb_utils: Any, tmp_path: Path) -> None:
    model = load_model_module("preprocessing").TritonPythonModel()
    with pytest.raises(ValueError, match="tokenizer_dir"):
        model.initialize(model_args({}, PRE_OUTPUTS))
    with pytest.raises(ValueError, match="tokenizer.json"):
        model.initialize(model_args({"tokenizer_dir": tmp_path}, PRE_OUTPUTS))
    with pytest.raises(ValueError, match="unfilled"):
        model.initialize(model_args({"tokenizer_dir": "${tokenizer_dir}"}, PRE_OUTPUTS))


# ============================================================================ postprocessing
@pytest.fixture
def postprocessing(pb_utils: Any, tokenizer_dir: Path) -> Any:
    model = load_model_module("postprocessing").TritonPythonModel()
    model.initialize(model_args({"tokenizer_dir": tokenizer_dir}, {"OUTPUT": "TYPE_STRING"}))
    return model


def test_postprocessing_decodes_up_to_sequence_length(postprocessing: Any, tokenizer_dir: Path) -> None:
    tok = tok_of(tokenizer_dir)
    a, b = tok.encode("Zürich café").ids, tok.encode("lazy dog").ids
    tokens = np.full((2, 1, max(len(a), len(b)) + 3), 5, dtype=np.int32)
    tokens[0, 0, : len(a)], tokens[1, 0, : len(b)] = a, b
    [resp] = postprocessing.execute([FakeRequest({"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": [[len(a)], [len(b)]]})])
    out = resp.get("OUTPUT")
    assert out.shape == (2,), "one flat array of batch x beams strings, as upstream's model returns"
    assert [x.decode() for x in out] == ["Zürich café", "lazy dog"], "special <s> skipped, padding cut"
    assert isinstance(out[0], bytes), "clients read output[0] as bytes"


def test_postprocessing_keeps_special_tokens_when_asked(pb_utils: Any, tokenizer_dir: Path) -> None:
    model = load_model_module("postprocessing").TritonPythonModel()
    params = {"tokenizer_dir": tokenizer_dir, "skip_special_tokens": "no"}
    model.initialize(model_args(params, {"OUTPUT": "TYPE_STRING"}))
    ids = tok_of(tokenizer_dir).encode("kiln").ids
    [resp] = model.execute([FakeRequest({"TOKENS_BATCH": [[ids]], "SEQUENCE_LENGTH": [[len(ids)]]})])
    assert resp.get("OUTPUT")[0].decode().startswith("<s>")


def test_chunks_cut_at_character_boundaries_decode_to_the_whole_text(pb_utils: Any, tokenizer_dir: Path) -> None:
    """Byte-level BPE: '東京😀' spans several tokens per character. Cut anywhere, a chunk ending inside a
    character decodes to U+FFFD; cut at character boundaries, the pieces concatenate to the whole text."""
    post = load_model_module("postprocessing")
    import kiln_triton_utils as utils  # on sys.path once a model is loaded, as in a served repository

    tok = tok_of(tokenizer_dir)
    text = "東京 😀 café"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text), "the tokenizer splits these characters over several tokens"
    pieces = [tok.decode(ids[i : i + 1]) for i in range(len(ids))]
    assert "".join(pieces) != text and utils.REPLACEMENT in "".join(pieces)
    sent, out = 0, ""
    for n in range(1, len(ids) + 1):  # the incremental detokenizer (BLS accumulate mode)
        delta, sent = post.decode_delta(tok, ids[:n], sent, True, final=n == len(ids))
        assert utils.REPLACEMENT not in delta
        out += delta
    assert out == text


def test_postprocessing_reports_malformed_input(postprocessing: Any) -> None:
    [resp] = postprocessing.execute([FakeRequest({"TOKENS_BATCH": np.zeros((1, 1, 2, 2), np.int32)})])
    assert "TOKENS_BATCH must be [batch, beams, tokens]" in error_of(resp)




# ============================================================================ kiln_triton_utils (shipped beside every model)
def test_helper_module_imports_without_kiln_or_the_triton_stub() -> None:
    """What a served repository relies on: only the model's version directory on sys.path, no kiln installed,
    no triton_python_backend_utils until a request is read."""
    code = (
        f"import sys; sys.path.insert(0, {str(MODELS_DIR)!r}); import kiln_triton_utils as u; "
        "assert not [m for m in sys.modules if m == 'kiln' or m.startswith('kiln.')], sorted(sys.modules); "
        "assert 'triton_python_backend_utils' not in sys.modules; print(u.parse_bool('on'))"
    )
    proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), (" YES ", True), ("on", True), ("1", True), ("off", False), ("F", False), ("0", False),
     ("maybe", None), ("", None), (None, None)],
)
def test_parse_bool_spellings(raw: str | None, expected: bool | None) -> None:
    from kiln.triton.models.kiln_triton_utils import parse_bool

    assert parse_bool(raw) is expected


def test_parameter_helpers_treat_empty_and_unfilled_as_absent() -> None:
    from kiln.triton.models import kiln_triton_utils as u

    cfg = json.loads(model_args({"a": " 7 ", "b": "", "c": "${c}", "d": "off", "e": "seven", "f": "2"}, {})["model_config"])
    assert u.get_param(cfg, "a") == "7" and u.get_param(cfg, "b", "dflt") == "dflt" and u.get_param(cfg, "c") is None
    assert u.get_int_param(cfg, "a", 0) == 7 and u.get_int_param(cfg, "c", 3) == 3
    assert u.get_bool_param(cfg, "d", True) is False and u.get_bool_param(cfg, "missing", True) is True
    with pytest.raises(ValueError, match="'e' must be an integer, got 'seven'"):
        u.get_int_param(cfg, "e", 0)
    with pytest.raises(ValueError, match="'e' must be true or false"):
        u.get_bool_param(cfg, "e", False)
    with pytest.raises(ValueError, match="'f' must be at least 4, got 2"):
        u.get_int_param(cfg, "f", 8, minimum=4)
    assert u.resolve_path({"model_repository": "/m/x"}, "1/tok") == "/m/x/1/tok"
    assert u.resolve_path({"model_repository": "/m/x"}, "/abs") == "/abs" and u.resolve_path({}, None) is None


def test_text_delta_holds_back_an_incomplete_character() -> None:
    from kiln.triton.models.kiln_triton_utils import REPLACEMENT, text_delta

    assert text_delta("ab" + REPLACEMENT, 0, final=False) == ("ab", 2)
    assert text_delta("ab" + REPLACEMENT, 2, final=False) == ("", 2)
    assert text_delta("abc", 2, final=False) == ("c", 3)
    assert text_delta("ab" + REPLACEMENT, 2, final=True) == (REPLACEMENT, 3)
