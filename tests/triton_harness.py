"""Shared by the tests of kiln's Triton Python models (test_triton_models, test_triton_reference,
test_triton_bls) and by test_server: the tiny quantized model, a stand-in for ``triton_python_backend_utils``,
the model loader and the fixtures the test modules share (they import the ones they use by name).

The stand-in has the behaviour the real module has for the calls these models make: tensors, requests with a
response sender, responses, errors, the logger and BLS calls (``InferenceRequest(...).exec()``, which run
another in-process model from :data:`BLS_MODELS`). It is a stand-in, named as one: the real stub is exercised
by test_server, which serves the same models on a real tritonserver.
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

from kiln.triton.upstream import MODELS as UPSTREAM

MODELS_DIR = Path(__file__).resolve().parents[1] / "src" / "kiln" / "triton" / "models"
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


# ============================================================================ tiny model
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
    """Import ``src/kiln/triton/models/<name>/model.py`` as Triton's stub would (needs the pb_utils fixture).

    The stub puts the model's version directory on ``sys.path``, where kiln ships ``kiln_triton_utils.py`` and
    the model's other modules beside ``model.py``; here the source directories that hold them go on ``sys.path``.
    """
    for folder in (MODELS_DIR, MODELS_DIR / name):  # the helper, and the modules kiln ships beside model.py
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
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


# ============================================================================ shared fixtures and helpers
#: Every output upstream's preprocessing config declares (what kiln's repositories declare too).
PRE_OUTPUTS = {t.name: t.data_type for t in UPSTREAM["preprocessing"].outputs}
#: The ones a text request gets back, as from upstream's model (the vision outputs are never produced, the
#: prompt-table ids only when PROMPT_TABLE_EXTRA_ID is sent).
PRE_TEXT_OUTPUTS = {
    "INPUT_ID", "REQUEST_INPUT_LEN", "DECODER_INPUT_ID", "REQUEST_DECODER_INPUT_LEN", "BAD_WORDS_IDS",
    "STOP_WORDS_IDS", "EMBEDDING_BIAS", "REQUEST_OUTPUT_LEN", "OUT_END_ID", "OUT_PAD_ID",
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


def tok_of(tokenizer_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def ref(pb_utils: Any) -> types.ModuleType:
    return load_model_module("reference")


def make_seq(ref: Any, **kwargs: Any) -> Any:
    return ref.Sequence(rid="r", prompt=[0], max_new=10, end_id=1, pad_id=1, sampling=ref.make_sampling(), **kwargs)


LLM_OUTPUTS = {
    "output_ids": "TYPE_INT32", "sequence_length": "TYPE_INT32", "cum_log_probs": "TYPE_FP32",
    "output_log_probs": "TYPE_FP32", "num_input_tokens": "TYPE_INT32", "num_output_tokens": "TYPE_INT32",
    "batch_index": "TYPE_INT32",
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
