"""The built-in tiny model: corpus splits, cache behaviour, loading, perplexity, determinism."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
import threading
import time

import pytest

from kiln.models import corpus, tiny
from kiln.models.tiny import (
    BUILD_RECORD,
    REQUIRED_FILES,
    TINY_LLAMA,
    TinyLlamaRecipe,
    build_tiny_llama,
    cache_root,
    calibration_texts,
    ensure_tiny_llama,
    heldout_texts,
    tiny_llama_dir,
    tiny_llama_key,
)
from kiln.util.errors import KilnError

# ------------------------------------------------------------------------------------------ corpus


def test_splits_are_disjoint_and_not_empty() -> None:
    calib, held = calibration_texts(), heldout_texts()
    assert len(calib) > 1000 and len(held) > 50
    assert not set(corpus.TRAIN_MODULES) & set(corpus.HELDOUT_MODULES)
    assert not set(calib) & set(held)
    # No held-out document appears inside any training document either (checked on a distinctive slice).
    joined = "\x00".join(calib)
    assert not [doc for doc in held if doc[len(doc) // 3 : len(doc) // 3 + 120] in joined]


def test_splits_have_a_fixed_order_and_return_fresh_lists() -> None:
    first = calibration_texts()
    first.clear()  # a caller mutating its list must not change what others get
    assert calibration_texts() == calibration_texts() and calibration_texts()
    assert heldout_texts() == heldout_texts()
    # Shuffled: the first documents come from several modules, not all from the first listed one.
    starts = calibration_texts()[:32]
    assert sum(doc in "\n".join(corpus.split_documents(_module_text("abc"))) for doc in starts) < 8


def _module_text(name: str) -> str:
    return (corpus.stdlib_dir() / f"{name}.py").read_text(encoding="utf-8")


def test_split_documents_keeps_text_and_bounds_sizes() -> None:
    text = _module_text("argparse")
    docs = corpus.split_documents(text)
    assert len(docs) > 20
    assert "".join(text.split()) == "".join("".join(docs).split())  # nothing lost but blank lines
    assert all(corpus.DOC_MIN_CHARS <= len(doc) for doc in docs)
    assert max(len(doc) for doc in docs) <= 2 * corpus.DOC_MAX_CHARS


def test_missing_stdlib_sources_give_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(corpus, "stdlib_dir", lambda: tmp_path)
    corpus._module_sources.cache_clear()
    try:
        with pytest.raises(KilnError, match=r"standard-library sources.*\.pyc"):
            corpus._module_sources(("abc", "argparse"))
    finally:
        corpus._module_sources.cache_clear()


# ------------------------------------------------------------------------------------------- cache


def test_cache_root_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root() == tmp_path / "k"
    monkeypatch.delenv("KILN_CACHE_DIR")
    assert cache_root() == tmp_path / "x" / "kiln"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kiln"


def test_cache_key_follows_the_recipe(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert tiny_llama_key() == tiny_llama_key(TinyLlamaRecipe())
    assert tiny_llama_key(TinyLlamaRecipe(seed=7)) != tiny_llama_key()
    assert tiny_llama_key(TinyLlamaRecipe(train_steps=10)) != tiny_llama_key()
    before = tiny_llama_key()
    monkeypatch.setattr(tiny, "BUILDER_VERSION", tiny.BUILDER_VERSION + 1)
    assert tiny_llama_key() != before
    assert tiny_llama_dir().parent == tmp_path / "models"
    assert tiny_llama_dir().name == f"tiny-llama-{tiny_llama_key()}"


class _FakeBuilder:
    """Stands in for the two-minute build: writes the required files, optionally slowly or failing."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.calls = 0
        self.delay = delay
        self.fail = fail
        self.seen_dirs: list[pathlib.Path] = []

    def __call__(self, out_dir: pathlib.Path, progress: bool = True) -> None:
        self.calls += 1
        self.seen_dirs.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("interrupted")
        for name in REQUIRED_FILES:
            (out_dir / name).write_text("{}")


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> pathlib.Path:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    return tmp_path / "models"


def test_ensure_builds_once_into_a_renamed_temp_dir(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path) -> None:
    fake = _FakeBuilder()
    monkeypatch.setattr(tiny, "build_tiny_llama", fake)
    path = ensure_tiny_llama(progress=False)
    assert path == tiny_llama_dir() and all((path / name).is_file() for name in REQUIRED_FILES)
    assert fake.seen_dirs[0] != path and fake.seen_dirs[0].parent == path.parent  # a sibling, then renamed
    assert not fake.seen_dirs[0].exists()
    assert ensure_tiny_llama(progress=False) == path
    assert fake.calls == 1


def test_failed_build_leaves_nothing_a_later_call_accepts(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path) -> None:
    monkeypatch.setattr(tiny, "build_tiny_llama", _FakeBuilder(fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        ensure_tiny_llama(progress=False)
    assert not tiny_llama_dir().exists()
    assert not list(cache.glob(".tiny-llama-*"))  # the temporary directory is gone too
    good = _FakeBuilder()
    monkeypatch.setattr(tiny, "build_tiny_llama", good)
    assert ensure_tiny_llama(progress=False).is_dir() and good.calls == 1


def test_incomplete_dir_and_stale_temp_dirs_are_rebuilt(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path) -> None:
    final = tiny_llama_dir()
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # e.g. someone deleted the weights by hand
    stale = cache / f".{final.name}.tmp-dead"
    stale.mkdir()
    fake = _FakeBuilder()
    monkeypatch.setattr(tiny, "build_tiny_llama", fake)
    assert ensure_tiny_llama(progress=False) == final
    assert fake.calls == 1 and (final / "model.safetensors").is_file() and not stale.exists()


def test_concurrent_callers_build_once(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path) -> None:
    fake = _FakeBuilder(delay=0.5)
    monkeypatch.setattr(tiny, "build_tiny_llama", fake)
    results: list[pathlib.Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_llama(progress=False))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fake.calls == 1
    assert results == [tiny_llama_dir()] * 3


def test_build_refuses_a_non_empty_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(KilnError, match="not empty"):
        build_tiny_llama(tmp_path, progress=False)


# ------------------------------------------------------------------------------------------- model


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    """The cached built-in model (built on first use: about two minutes on two cores)."""
    return ensure_tiny_llama(progress=False)


def test_model_shape_suits_quantization(model_dir: pathlib.Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] % 128 == 0 and config["intermediate_size"] % 128 == 0  # AWQ block size
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"
    record = json.loads((model_dir / BUILD_RECORD).read_text())
    assert record["name"] == TINY_LLAMA and 1_000_000 <= record["parameters"] <= 3_000_000


def test_model_and_tokenizers_load_and_agree(model_dir: pathlib.Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    for text in heldout_texts()[:5] + ["héllo wörld ✓ \t\n  tabs"]:
        ids = hf(text).input_ids
        assert ids == raw.encode(text).ids
        assert ids[0] == hf.bos_token_id
        assert raw.decode(ids) == text and hf.decode(ids, skip_special_tokens=True) == text


def test_heldout_perplexity_is_far_below_uniform(model_dir: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    nll, count = 0.0, 0
    with torch.no_grad():
        for text in heldout_texts():
            ids = torch.tensor([tok(text).input_ids[:512]])
            nll += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    ppl = math.exp(nll / count)
    assert ppl < model.config.vocab_size / 10  # uniform guessing would be vocab_size (4096)
    record = json.loads((model_dir / BUILD_RECORD).read_text())
    assert ppl == pytest.approx(record["heldout_perplexity"], rel=1e-3)


@pytest.mark.integration
def test_modelopt_int4_awq_quantizes_it(model_dir: pathlib.Path) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    calib = [torch.tensor([tok(text).input_ids[:128]]) for text in calibration_texts()[:4]]
    probe = torch.tensor([tok(heldout_texts()[0]).input_ids[:256]])
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for ids in calib:
                m(input_ids=ids)

    mtq.quantize(model, mtq.INT4_AWQ_CFG, forward_loop)
    with torch.no_grad():
        want, got = base(input_ids=probe, labels=probe), model(input_ids=probe, labels=probe)
    assert torch.isfinite(got.logits).all()
    assert not torch.equal(want.logits, got.logits)  # the weights really were fake-quantized
    assert got.loss.item() < want.loss.item() + 1.0  # ... and the model still works


def _hashes(directory: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


#: A short build: the default recipe with 6 training steps instead of 300 (2 of warm-up, then the cosine decay), so
#: every part of the builder runs (tokenizer training, seeded initialisation, data order, AdamW steps with both
#: learning-rate phases, held-out perplexity, saving) in seconds instead of minutes.
SHORT = dataclasses.replace(TinyLlamaRecipe(), train_steps=6, warmup_steps=2)


@pytest.mark.integration
def test_build_is_byte_identical(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Two builds of the same recipe are equal file for file, and the cached model's files that do not depend on
    the number of training steps (tokenizer, configs) equal a fresh build's.

    The determinism is shown on SHORT, whose builds run the same code as the default recipe's 300 steps (each
    training step is the same deterministic computation). The weights of the cached default model are checked
    against their build record by test_heldout_perplexity_is_far_below_uniform.
    """
    build_tiny_llama(tmp_path / "one", progress=False, recipe=SHORT)
    build_tiny_llama(tmp_path / "two", progress=False, recipe=SHORT)
    one, two = _hashes(tmp_path / "one"), _hashes(tmp_path / "two")
    assert set(one) >= set(REQUIRED_FILES) | {"generation_config.json"}
    assert one == two, "two builds of the same recipe differ: the builder is not deterministic"
    assert json.loads((tmp_path / "one" / BUILD_RECORD).read_text())["recipe"] == dataclasses.asdict(SHORT)
    cached = _hashes(model_dir)
    shared = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    assert {n: one[n] for n in shared} == {n: cached[n] for n in shared}, (
        "a fresh build's tokenizer or configs differ from the cached model's; if the builder changed on purpose, "
        "bump kiln.models.tiny.BUILDER_VERSION so the cache key changes"
    )
