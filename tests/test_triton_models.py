"""The Python-backend models kiln ships into Triton repositories, exercised without a server.

Each ``model.py`` is imported with a small stand-in for ``triton_python_backend_utils`` (the module the
Triton stub provides): tensors, requests with a response sender, responses, errors and the logger, with
the behaviour the real one has for the calls these models make. The reference model runs a real tiny
quantized Llama (ModelOpt INT8 SmoothQuant, saved with ``mto.save``) under transformers' continuous
batching, so its tests are marked ``integration``; the tokenizer models and the pure helpers are fast.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

MODELS_DIR = Path(__file__).resolve().parents[1] / "src" / "kiln" / "triton" / "models"
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


# ============================================================================ tiny model (shared with test_server)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog while the kiln fires the clay.",
    "Zürich café naïve déjà vu – “quotes” and façades; Tōkyō 東京 and 😀 emoji.",
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex.",
]


def build_tiny_model(out: Path, seed: int = 0) -> Path:
    """A deterministic 2-layer Llama with a byte-level BPE tokenizer, INT8-SmoothQuant-calibrated, in ``out``.

    Writes the Hugging Face files (config, weights, tokenizer) and ``modelopt_state.pth`` (``mto.save``).
    Idempotent: a complete ``out`` is reused (pytest may build it once per test module).
    """
    if (out / "modelopt_state.pth").is_file():
        return out
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    corpus = TRAINING_TEXT + [json.__doc__ or "", threading.__doc__ or ""]  # text that ships with Python
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(tmp)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp)
    batches = [torch.tensor([tok.encode(text).ids]) for text in corpus]

    def calibrate(m: Any) -> None:
        for ids in batches:
            m(ids)

    mtq.quantize(model, mtq.INT8_SMOOTHQUANT_CFG, calibrate)
    mto.save(model, tmp / "modelopt_state.pth")
    tmp.rename(out)
    return out


def load_restored_model(model_dir: Path) -> Any:
    """The tiny model as the reference runtime loads it: HF weights + ``mto.restore`` (fresh instance)."""
    import modelopt.torch.opt as mto
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    mto.restore(model, str(model_dir / "modelopt_state.pth"))
    return model


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int = 1) -> list[int]:
    """``model.generate`` greedy continuation (without the prompt, without a trailing end token)."""
    import torch

    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )[0, len(prompt_ids) :].tolist()
    return out[:-1] if out and out[-1] == eos_token_id else out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "kiln-tiny-int8sq")


# ======================================================================== a stand-in for triton_python_backend_utils
class FakeTensor:
    """pb_utils.Tensor: a named numpy array."""

    def __init__(self, name: str, array: Any) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeTritonError:
    def __init__(self, message: str, code: Any = None) -> None:
        self._message = message

    def message(self) -> str:
        return self._message


class FakeResponse:
    def __init__(self, output_tensors: list[FakeTensor] | None = None, error: FakeTritonError | None = None) -> None:
        self._tensors, self._error = list(output_tensors or []), error

    def output_tensors(self) -> list[FakeTensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> FakeTritonError | None:
        return self._error

    def get(self, name: str) -> np.ndarray | None:
        return next((t.as_numpy() for t in self._tensors if t.name() == name), None)


class FakeSender:
    """The response sender: records (response, flags); refuses to send after the final flag, like Triton's."""

    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse | None, int]] = []
        self.sent_at: list[float] = []
        self.cancelled = False
        self.closed = threading.Event()

    def send(self, response: FakeResponse | None = None, flags: int = 0) -> None:
        if self.closed.is_set():
            raise RuntimeError("Unable to send response. Response sender has been closed.")
        self.sent.append((response, flags))
        self.sent_at.append(time.monotonic())
        if flags & FINAL:
            self.closed.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def wait(self, timeout: float = 120.0) -> list[FakeResponse]:
        """Block until the final flag; return the responses that carry data or an error."""
        assert self.closed.wait(timeout), f"no final response within {timeout}s; sent so far: {self.sent}"
        return [r for r, _ in self.sent if r is not None]


class FakeRequest:
    """An incoming request: named input arrays and a response sender."""

    def __init__(self, inputs: dict[str, Any], request_id: str = "") -> None:
        self.inputs = {k: np.asarray(v) for k, v in inputs.items() if v is not None}
        self.sender = FakeSender()
        self._id = request_id

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.sender.cancelled

    def request_id(self) -> str:
        return self._id


#: Models reachable through BLS calls (pb_utils.InferenceRequest(...).exec()), by name.
BLS_MODELS: dict[str, Any] = {}


class FakeBLSRequest:
    """pb_utils.InferenceRequest as a BLS call: runs the named in-process model."""

    def __init__(
        self,
        model_name: str,
        inputs: list[FakeTensor],
        requested_output_names: list[str],
        request_id: str = "",
        **_: Any,
    ) -> None:
        self.model_name = model_name
        self.request = FakeRequest({t.name(): t.as_numpy() for t in inputs}, request_id)

    def exec(self, decoupled: bool = False) -> Any:
        model = BLS_MODELS[self.model_name]
        returned = model.execute([self.request])
        if returned is not None:  # a model that returns its responses from execute()
            self.request.sender.send(returned[0], FINAL)
        if decoupled:
            return self._live(self.request.sender)
        responses = self.request.sender.wait()
        assert len(responses) == 1, responses
        return responses[0]

    @staticmethod
    def _live(sender: FakeSender) -> Any:
        """Responses as the model sends them; Triton's iterator ends with an empty final response."""
        seen, deadline = 0, time.monotonic() + 120
        while time.monotonic() < deadline:
            while seen < len(sender.sent):
                response, flags = sender.sent[seen]
                seen += 1
                if response is not None:
                    yield response
                if flags & FINAL:
                    yield FakeResponse()
                    return
            time.sleep(0.002)
        raise AssertionError("no final response within 120s")


def _get_input(request: FakeRequest, name: str) -> FakeTensor | None:
    return FakeTensor(name, request.inputs[name]) if name in request.inputs else None


def _get_output(response: FakeResponse, name: str) -> FakeTensor | None:
    value = response.get(name)
    return None if value is None else FakeTensor(name, value)


def _config_by_name(kind: str) -> Any:
    def find(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
        return next((t for t in model_config.get(kind, []) if t["name"] == name), None)

    return find


class FakeLogger:
    lines: list[tuple[str, str]] = []

    @classmethod
    def log_info(cls, msg: str) -> None:
        cls.lines.append(("info", msg))

    @classmethod
    def log_warn(cls, msg: str) -> None:
        cls.lines.append(("warn", msg))

    @classmethod
    def log_error(cls, msg: str) -> None:
        cls.lines.append(("error", msg))

    @classmethod
    def log_verbose(cls, msg: str) -> None:
        cls.lines.append(("verbose", msg))


_NUMPY_TYPES = {
    "TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64,
    "TYPE_FP32": np.float32, "TYPE_FP16": np.float16, "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8,
}


def make_fake_pb_utils() -> types.ModuleType:
    fake = types.ModuleType("triton_python_backend_utils")
    fake.Tensor = FakeTensor
    fake.TritonError = FakeTritonError
    fake.InferenceResponse = FakeResponse
    fake.InferenceRequest = FakeBLSRequest
    fake.Logger = FakeLogger
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    fake.get_input_tensor_by_name = _get_input
    fake.get_output_tensor_by_name = _get_output
    fake.get_input_config_by_name = _config_by_name("input")
    fake.get_output_config_by_name = _config_by_name("output")
    fake.triton_string_to_numpy = lambda name: _NUMPY_TYPES[name]
    fake.using_decoupled_model_transaction_policy = lambda cfg: bool(
        cfg.get("model_transaction_policy", {}).get("decoupled", False)
    )
    return fake


@pytest.fixture(scope="session")
def pb_utils() -> Any:
    """Install the stand-in as ``triton_python_backend_utils`` for the whole session (restored afterwards)."""
    previous = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = make_fake_pb_utils()
    yield sys.modules["triton_python_backend_utils"]
    if previous is None:
        del sys.modules["triton_python_backend_utils"]
    else:
        sys.modules["triton_python_backend_utils"] = previous


def load_model_module(name: str) -> types.ModuleType:
    """Import ``src/kiln/triton/models/<name>/model.py`` as Triton's stub would (needs the pb_utils fixture)."""
    spec = importlib.util.spec_from_file_location(f"kiln_triton_model_{name}", MODELS_DIR / name / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_args(params: dict[str, Any], outputs: dict[str, str], decoupled: bool = False) -> dict[str, str]:
    """The ``args`` Triton passes to initialize(): the model config as JSON (only what the models read)."""
    config = {
        "max_batch_size": 8,
        "parameters": {k: {"string_value": str(v)} for k, v in params.items()},
        "output": [{"name": n, "data_type": t, "dims": [-1]} for n, t in outputs.items()],
        "model_transaction_policy": {"decoupled": decoupled},
    }
    return {"model_config": json.dumps(config), "model_name": "test", "model_version": "1"}


def text_array(*texts: str) -> np.ndarray:
    return np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)


def error_of(response: FakeResponse) -> str:
    names = [t.name() for t in response.output_tensors()]
    assert response.has_error(), f"expected an error response, got outputs {names}"
    return response.error().message()


# ============================================================================ preprocessing
PRE_OUTPUTS = {
    "INPUT_ID": "TYPE_INT32", "REQUEST_INPUT_LEN": "TYPE_INT32", "BAD_WORDS_IDS": "TYPE_INT32",
    "STOP_WORDS_IDS": "TYPE_INT32", "REQUEST_OUTPUT_LEN": "TYPE_INT32", "OUT_END_ID": "TYPE_INT32",
    "OUT_PAD_ID": "TYPE_INT32",
}


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Just the tiny model's tokenizer files (fast: no model, no ModelOpt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return out


@pytest.fixture
def preprocessing(pb_utils: Any, tokenizer_dir: Path) -> Any:
    module = load_model_module("preprocessing")
    model = module.TritonPythonModel()
    model.initialize(model_args({"tokenizer_dir": tokenizer_dir, "max_input_len": 24, "max_seq_len": 64}, PRE_OUTPUTS))
    return model


def _tok(tokenizer_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def test_preprocessing_tokenizes_and_pads_a_batch(preprocessing: Any, tokenizer_dir: Path) -> None:
    tok = _tok(tokenizer_dir)
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
    assert {t.name() for t in resp.output_tensors()} == set(PRE_OUTPUTS), "exactly the declared outputs"


def test_preprocessing_honours_add_special_tokens_false(pb_utils: Any, tokenizer_dir: Path) -> None:
    model = load_model_module("preprocessing").TritonPythonModel()
    model.initialize(model_args({"tokenizer_dir": tokenizer_dir, "add_special_tokens": "false"}, PRE_OUTPUTS))
    [resp] = model.execute([FakeRequest({"QUERY": text_array("kiln"), "REQUEST_OUTPUT_LEN": [[4]]})])
    assert resp.get("INPUT_ID")[0].tolist() == _tok(tokenizer_dir).encode("kiln", add_special_tokens=False).ids


def test_preprocessing_word_lists_use_upstream_layout(preprocessing: Any, tokenizer_dir: Path) -> None:
    tok = _tok(tokenizer_dir)
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
    tok = _tok(tokenizer_dir)
    a, b = tok.encode("Zürich café").ids, tok.encode("lazy dog").ids
    tokens = np.full((2, 1, max(len(a), len(b)) + 3), 5, dtype=np.int32)
    tokens[0, 0, : len(a)], tokens[1, 0, : len(b)] = a, b
    [resp] = postprocessing.execute([FakeRequest({"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": [[len(a)], [len(b)]]})])
    out = resp.get("OUTPUT")
    assert out.shape == (2, 1)
    assert [x.decode() for x in out[:, 0]] == ["Zürich café", "lazy dog"], "special <s> skipped, padding cut"


def test_postprocessing_keeps_special_tokens_when_asked(pb_utils: Any, tokenizer_dir: Path) -> None:
    model = load_model_module("postprocessing").TritonPythonModel()
    params = {"tokenizer_dir": tokenizer_dir, "skip_special_tokens": "no"}
    model.initialize(model_args(params, {"OUTPUT": "TYPE_STRING"}))
    ids = _tok(tokenizer_dir).encode("kiln").ids
    [resp] = model.execute([FakeRequest({"TOKENS_BATCH": [[ids]], "SEQUENCE_LENGTH": [[len(ids)]]})])
    assert resp.get("OUTPUT")[0, 0].decode().startswith("<s>")


def test_chunks_cut_at_character_boundaries_decode_to_the_whole_text(pb_utils: Any, tokenizer_dir: Path) -> None:
    """Byte-level BPE: '東京😀' spans several tokens per character. Cut anywhere, a chunk ending inside a
    character decodes to U+FFFD; cut at character boundaries, the pieces concatenate to the whole text."""
    post = load_model_module("postprocessing")
    tok = _tok(tokenizer_dir)
    text = "東京 😀 café"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text), "the tokenizer splits these characters over several tokens"
    pieces = [tok.decode(ids[i : i + 1]) for i in range(len(ids))]
    assert "".join(pieces) != text and post.REPLACEMENT in "".join(pieces)
    sent, out = 0, ""
    for n in range(1, len(ids) + 1):  # the incremental detokenizer (BLS accumulate mode)
        delta, sent = post.decode_delta(tok, ids[:n], sent, True, final=n == len(ids))
        assert post.REPLACEMENT not in delta
        out += delta
    assert out == text


def test_postprocessing_reports_malformed_input(postprocessing: Any) -> None:
    [resp] = postprocessing.execute([FakeRequest({"TOKENS_BATCH": np.zeros((1, 1, 2, 2), np.int32)})])
    assert "TOKENS_BATCH must be [batch, beams, tokens]" in error_of(resp)


# ============================================================================ reference (tensorrt_llm): pure parts
@pytest.fixture(scope="session")
def ref(pb_utils: Any) -> types.ModuleType:
    return load_model_module("reference")


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


def _seq(ref: Any, **kwargs: Any) -> Any:
    return ref.Sequence(rid="r", prompt=[0], max_new=10, end_id=1, pad_id=1, sampling=ref.make_sampling(), **kwargs)


def test_sequence_drops_end_id_and_stops_after_stop_words(ref: Any) -> None:
    seq = _seq(ref, stop_words=[[7, 8]])
    assert not seq.update([5, 7], finished=False) and seq.tokens == [5, 7]
    assert seq.update([5, 7, 8, 9], finished=False) and seq.tokens == [5, 7, 8], "stop word kept, rest cut"
    seq = _seq(ref)
    assert seq.update([5, 6, 1], finished=True) and seq.tokens == [5, 6], "the end id is not output"


def test_sequence_verifies_draft_tokens(ref: Any) -> None:
    seq = _seq(ref, draft=[4, 5, 6])
    assert not seq.update([4, 5], finished=False)
    assert seq.update([4, 5, 9], finished=False) and seq.tokens == [4, 5, 9], "accepted + the target's own token"
    seq = _seq(ref, draft=[4, 5])
    assert seq.update([4, 5, 6], finished=True) and seq.tokens == [4, 5, 6], "all accepted + one bonus token"


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
LLM_OUTPUTS = {
    "output_ids": "TYPE_INT32", "sequence_length": "TYPE_INT32", "cum_log_probs": "TYPE_FP32",
    "output_log_probs": "TYPE_FP32",
}
RUNTIME_PARAMS = {"tokens_per_block": 16, "max_tokens_in_paged_kv_cache": 1024, "max_num_tokens": 256, "num_threads": 2}


def start_reference(ref: Any, model_dir: Path, decoupled: bool, **params: Any) -> Any:
    model = ref.TritonPythonModel()
    model.initialize(model_args({"model_dir": model_dir, **RUNTIME_PARAMS, **params}, LLM_OUTPUTS, decoupled))
    return model


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> Any:
    return load_restored_model(tiny_model)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@pytest.fixture(scope="module")
def llm(ref: Any, tiny_model: Path) -> Any:
    """A decoupled reference model (streaming capable), shared by the module; finalized at the end."""
    model = start_reference(ref, tiny_model, decoupled=True)
    yield model
    model.finalize()


def llm_request(prompts: list[list[int]], max_new: int, **extra: Any) -> FakeRequest:
    """A tensorrt_llm request; scalar inputs shaped [batch] as Triton delivers them with reshape: { shape: [ ] }."""
    width = max(len(p) for p in prompts)
    ids = np.ones((len(prompts), width), dtype=np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    inputs: dict[str, Any] = {
        "input_ids": ids,
        "input_lengths": np.array([len(p) for p in prompts], dtype=np.int32),
        "request_output_len": np.full(len(prompts), max_new, dtype=np.int32),
    }
    for name, value in extra.items():
        inputs[name] = value if isinstance(value, np.ndarray) else np.full(len(prompts), value)
    return FakeRequest(inputs)


def generated(response: FakeResponse) -> list[list[int]]:
    ids, lengths = response.get("output_ids"), response.get("sequence_length")
    return [ids[b, 0, : lengths[b, 0]].tolist() for b in range(ids.shape[0])]


def streamed(responses: list[FakeResponse]) -> list[list[int]]:
    """Per response, the first batch item's new tokens."""
    return [generated(r)[0] for r in responses]


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
    [resp] = batch.sender.wait()
    assert generated(resp) == [hf_greedy(hf_model, p, 12) for p in prompts]


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
    tok = _tok(tokenizer_dir)
    ids = tok.encode("a東", add_special_tokens=False).ids
    assert tok.decode(ids[:-1]).endswith(ref.REPLACEMENT), "'東' spans several byte-level tokens"
    model = ref.TritonPythonModel.__new__(ref.TritonPythonModel)
    model.tokenizer = tok
    seq = _seq(ref)
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
        ({"beam_width": 2}, 4, "beam_width=2 is not supported"),
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
        pieces.append(resp.get("text_output")[0, 0].decode("utf-8"))
    return pieces, request


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
