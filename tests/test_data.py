"""Calibration/evaluation text: reading each kind of source, the errors users get, tokenization, hashing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest

from kiln.models.data import batches, content_hash, load_texts, tokenize_samples
from kiln.recipe.schema import CalibrationSection, EvaluationSection
from kiln.util.errors import InputError


@dataclass
class Source:
    dataset: str
    subset: Optional[str] = None
    split: str = "train"
    column: str = "text"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A word-level tokenizer made in memory (no download): one id per distinct word, BOS prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(50)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


# --------------------------------------------------------------------------------------------- local files


def test_txt_paragraphs_split_on_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("first para\nstill first\n\nsecond\n  \n\n\nthird one\n\n", encoding="utf-8")
    assert load_texts(Source(str(f))) == ["first para\nstill first", "second", "third one"]


def test_jsonl_reads_the_named_key(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    rows = [{"article": "a b", "id": 1}, {"article": "c d", "id": 2}, {"article": None, "id": 3}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert load_texts(Source(str(f), column="article")) == ["a b", "c d"]


def test_parquet_reads_the_named_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["x y", "", "z"], "n": [1, 2, 3]}), f)
    assert load_texts(Source(str(f), column="body")) == ["x y", "z"]


def test_schema_sections_are_accepted(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("a\n\nb", encoding="utf-8")
    assert load_texts(CalibrationSection(dataset=str(f))) == ["a", "b"]
    assert load_texts(EvaluationSection(dataset=str(f)), "evaluation") == ["a", "b"]


def test_builtin_splits_are_disjoint_and_nonempty() -> None:
    calib = load_texts(Source("builtin:tiny-llama-calib"))
    held = load_texts(Source("builtin:tiny-llama-heldout"))
    assert len(calib) > 32 and len(held) > 16
    assert not set(calib) & set(held)


# --------------------------------------------------------------------------------------------- errors


def _error(source: Source, key: str = "quantization.calibration") -> str:
    with pytest.raises(InputError) as info:
        load_texts(source, key)
    return str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    msg = _error(Source(str(tmp_path / "nope.jsonl")))
    assert "not found" in msg and "quantization.calibration.dataset" in msg


def test_unknown_extension(tmp_path: Path) -> None:
    f = tmp_path / "c.csv"
    f.write_text("text\nhello\n", encoding="utf-8")
    msg = _error(Source(str(f)))
    assert "'.csv'" in msg and ".jsonl" in msg and ".parquet" in msg


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    d = tmp_path / "data.txt"
    d.mkdir()
    assert "not a file" in _error(Source(str(d)))


def test_not_utf8(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_bytes(b"caf\xe9 ol\xe9\n")
    assert "not UTF-8" in _error(Source(str(f)))


def test_jsonl_missing_column_lists_the_keys(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text('{"article": "a", "id": 1}\n', encoding="utf-8")
    msg = _error(Source(str(f), column="text"), "evaluation")
    assert "evaluation.column" in msg and "'text'" in msg and "article" in msg


def test_jsonl_non_text_column(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": 3}\n{"text": 4}\n', encoding="utf-8")
    msg = _error(Source(str(f)))
    assert "int" in msg and "not text" in msg


def test_jsonl_bad_line_is_named(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "ok"}\n{"text": \n', encoding="utf-8")
    assert f"{f}:2" in _error(Source(str(f)))


def test_empty_column(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": ""}\n{"text": "   "}\n', encoding="utf-8")
    assert "holds no text" in _error(Source(str(f)))


def test_empty_txt(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("\n\n  \n", encoding="utf-8")
    assert "holds no text" in _error(Source(str(f)))


def test_parquet_missing_and_non_text_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "c.parquet"
    pq.write_table(pa.table({"n": [1, 2], "body": ["a", "b"]}), f)
    msg = _error(Source(str(f), column="text"))
    assert "no column 'text'" in msg and "body" in msg
    assert "not text" in _error(Source(str(f), column="n"))


def test_corrupt_parquet(tmp_path: Path) -> None:
    f = tmp_path / "c.parquet"
    f.write_bytes(b"this is not parquet at all")
    assert "not a readable Parquet file" in _error(Source(str(f)))


def test_hub_dataset_failure_is_an_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A download that fails (here: no network, as datasets reports it) is the user's to fix, not a crash."""
    import datasets

    def offline(*_a: Any, **_k: Any) -> None:
        raise ConnectionError("Couldn't reach 'kiln-test/definitely-not-a-dataset' on the Hub "
                              "(LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    msg = _error(Source("hf:kiln-test/definitely-not-a-dataset@main", subset="x", split="train"))
    assert "cannot load kiln-test/definitely-not-a-dataset (x) split 'train'" in msg
    assert "Couldn't reach" in msg and "quantization.calibration.split" in msg


def test_hub_dataset_column_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub path's column checks, on an in-memory datasets.Dataset standing in for the download."""
    import datasets

    calls = {}

    def fake_load(repo: str, subset: Optional[str], split: str, revision: Optional[str]) -> datasets.Dataset:
        calls.update(repo=repo, subset=subset, split=split, revision=revision)
        return datasets.Dataset.from_dict({"article": ["a b", "c"], "n": [1, 2]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    src = Source("hf:org/data@v1", subset="3.0.0", split="validation", column="article")
    assert load_texts(src) == ["a b", "c"]
    assert calls == {"repo": "org/data", "subset": "3.0.0", "split": "validation", "revision": "v1"}
    assert "no column 'text'" in _error(Source("hf:org/data", column="text"))
    assert "not text" in _error(Source("hf:org/data", column="n"))


# --------------------------------------------------------------------------------------------- tokenize


def test_tokenize_truncates_and_adds_bos(tokenizer: Any) -> None:
    texts = [" ".join(f"w{i}" for i in range(20)), "w1 w2"]
    out = tokenize_samples(texts, tokenizer, samples=2, max_seq_len=8, seed=0)
    assert [len(t) for t in out] == [8, 3]
    assert int(out[0][0]) == 1 and out[0].dtype.is_floating_point is False


def test_tokenize_seeded_choice_is_deterministic_and_ordered(tokenizer: Any) -> None:
    texts = [f"w{i} w{i}" for i in range(40)]
    a = tokenize_samples(texts, tokenizer, samples=10, max_seq_len=8, seed=7)
    b = tokenize_samples(texts, tokenizer, samples=10, max_seq_len=8, seed=7)
    c = tokenize_samples(texts, tokenizer, samples=10, max_seq_len=8, seed=8)
    first = [int(t[1]) for t in a]
    assert first == [int(t[1]) for t in b] and first == sorted(first)
    assert first != [int(t[1]) for t in c]
    head = tokenize_samples(texts, tokenizer, samples=3, max_seq_len=8, seed=None)
    assert [int(t[1]) for t in head] == [3, 4, 5]


def test_fewer_usable_samples_than_asked(tokenizer: Any) -> None:
    texts = ["w1 w2 w3", "w4 w5", ""]  # the empty text tokenizes to BOS only: not usable
    with pytest.raises(InputError) as info:
        tokenize_samples(texts, tokenizer, samples=5, max_seq_len=8, seed=0)
    msg = str(info.value)
    assert "only 2 usable" in msg and "quantization.calibration.samples" in msg


def test_batches_pad_and_mask(tokenizer: Any) -> None:
    seqs = tokenize_samples(["w1 w2 w3", "w4", "w5 w6"], tokenizer, samples=3, max_seq_len=8, seed=None)
    out = batches(seqs, batch_size=2, pad_id=2)
    assert [tuple(b["input_ids"].shape) for b in out] == [(2, 4), (1, 3)]
    assert out[0]["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert out[0]["input_ids"][1].tolist()[2:] == [2, 2]


# --------------------------------------------------------------------------------------------- hashing


def test_content_hash_tracks_file_bytes(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text("a\n\nb", encoding="utf-8")
    h1 = content_hash(Source(str(f)))
    assert h1 == content_hash(Source(str(f))) and h1.startswith("sha256:")
    f.write_text("a\n\nc", encoding="utf-8")
    assert content_hash(Source(str(f))) != h1


def test_content_hash_of_hub_and_builtin_sources() -> None:
    base = Source("hf:org/data@v1", subset="s", split="train", column="text")
    h = content_hash(base)
    assert h == content_hash(Source("hf:org/data@v1", subset="s", split="train", column="text"))
    for other in (Source("hf:org/data@v2", subset="s"), Source("hf:org/data@v1", subset="t"),
                  Source("hf:org/data@v1", subset="s", split="test"), Source("hf:org/data@v1", subset="s", column="x")):
        assert content_hash(other) != h
    assert content_hash(Source("builtin:tiny-llama-calib")) != content_hash(Source("builtin:tiny-llama-heldout"))
