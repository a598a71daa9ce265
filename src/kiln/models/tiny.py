"""The built-in default model, ``builtin:tiny-llama``: a small Llama made locally, with no download.

kiln makes it once and caches it:

1. a byte-level BPE tokenizer is trained (``tokenizers``) on the calibration split of
   :mod:`kiln.models.corpus` (Python standard-library sources);
2. a ``LlamaForCausalLM`` of about 1.8M parameters (grouped-query attention, untied ``lm_head``, hidden
   and MLP sizes multiples of 128 so that INT4-AWQ / W4A8 block quantization applies) is trained on the
   same text for a few hundred AdamW steps on the CPU, enough for perplexity and quantization error to
   mean something;
3. both are written as a Hugging Face directory (float32 weights) that
   ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` load, and whose
   ``tokenizer.json`` loads with ``tokenizers.Tokenizer.from_file``.

The build is deterministic: the same recipe, corpus and library versions give byte-identical files on
the same machine (fixed seeds, deterministic algorithms, a fixed thread count, a fixed data order). The
cache directory is keyed by all of those (:func:`tiny_llama_key`), built in a temporary sibling and
renamed into place when complete, and guarded by a file lock against concurrent builders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kiln.models.corpus import calibration_texts, corpus_digest, corpus_files, heldout_texts
from kiln.util.errors import KilnError
from kiln.util.paths import cache_root

if TYPE_CHECKING:  # heavy imports stay lazy: importing this module must stay cheap
    import torch
    from rich.console import Console
    from tokenizers import Tokenizer

__all__ = [
    "BUILDER_VERSION",
    "TINY_LLAMA",
    "TinyLlamaRecipe",
    "build_tiny_llama",
    "builtin_chat_template",
    "cache_root",
    "calibration_texts",
    "ensure_tiny_llama",
    "heldout_texts",
    "tiny_llama_dir",
    "tiny_llama_key",
]

#: The recipe name of the built-in model.
TINY_LLAMA = "builtin:tiny-llama"
#: Bump whenever the builder's code changes what it writes: it is part of the cache key.
BUILDER_VERSION = 1

#: The special tokens, in id order (ids 0..3).
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)
#: The chat template kiln gives the built-in model (it has none of its own: it never saw chat data). It is added
#: when a repository is packaged, not when the model is built, so it is not part of the model's cache key.
CHAT_TEMPLATE_FILE = "tiny-llama.chat_template.jinja"
#: A file written last into the model directory, with the recipe and the training figures.
BUILD_RECORD = "kiln_tiny_llama.json"
#: Files a finished model directory always has.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", BUILD_RECORD)


@dataclasses.dataclass(frozen=True)
class TinyLlamaRecipe:
    """Everything that decides the built model's bytes (besides the corpus and library versions)."""

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    train_steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    #: Fixed CPU thread count while training: results can depend on how reductions are split.
    threads: int = 2


DEFAULT_RECIPE = TinyLlamaRecipe()


# --------------------------------------------------------------------------------------------- cache


def builtin_chat_template(source: str) -> str | None:
    """The chat template kiln ships for a built-in model source (``builtin:tiny-llama``), None for other sources
    (their tokenizer's own template, if any, is used)."""
    if source != TINY_LLAMA:
        return None
    from importlib import resources

    return (resources.files("kiln.models") / "data" / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


def _library_versions() -> dict[str, str]:
    """Versions of the libraries whose numerics or file formats shape the build."""
    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "tokenizers", "safetensors")}


def _key_material(recipe: TinyLlamaRecipe) -> dict[str, Any]:
    return {
        "builder_version": BUILDER_VERSION,
        "recipe": dataclasses.asdict(recipe),
        "corpus_sha256": corpus_digest(),
        "libraries": _library_versions(),
    }


def tiny_llama_key(recipe: TinyLlamaRecipe = DEFAULT_RECIPE) -> str:
    """The cache key: a hash of the builder version, recipe, corpus text and library versions."""
    blob = json.dumps(_key_material(recipe), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tiny_llama_dir(recipe: TinyLlamaRecipe = DEFAULT_RECIPE) -> pathlib.Path:
    """Where the cached model for this recipe lives (it may not exist yet)."""
    return cache_root() / "models" / f"tiny-llama-{tiny_llama_key(recipe)}"


def _is_complete(path: pathlib.Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in REQUIRED_FILES)


def ensure_tiny_llama(progress: bool = True) -> pathlib.Path:
    """The Hugging Face directory of ``builtin:tiny-llama``, building it first if it is not cached yet.

    Builds go into a temporary sibling directory that is renamed into place only when complete, so an
    interrupted build is never mistaken for a model; a file lock makes concurrent callers wait for one
    builder instead of all building.
    """
    from filelock import FileLock, Timeout

    final = tiny_llama_dir()
    if _is_complete(final):
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KilnError(
            f"cannot create the model cache {final.parent}: {exc}. Point KILN_CACHE_DIR at a writable directory."
        ) from exc
    lock = FileLock(str(final) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            _console().print(f"[kiln] waiting for another process that is building {TINY_LLAMA} …")
        lock.acquire()
    try:
        if _is_complete(final):  # another process finished it while we waited
            return final
        if final.exists():  # only a rename creates it, so files were removed by hand: rebuild
            shutil.rmtree(final)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # left by killed builders; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            build_tiny_llama(tmp, progress=progress)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        lock.release()
    return final


# --------------------------------------------------------------------------------------------- build


def build_tiny_llama(out_dir: pathlib.Path, progress: bool = True, recipe: TinyLlamaRecipe = DEFAULT_RECIPE) -> None:
    """Build the tiny model into ``out_dir`` (created if missing; it must be empty).

    Writes config.json, generation_config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json and kiln_tiny_llama.json (recipe, corpus, library versions, final training
    loss and held-out perplexity). Takes about two minutes on two CPU cores.
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise KilnError(f"cannot build {TINY_LLAMA} into {out_dir}: the directory is not empty. Give an empty one.")
    console = _console()
    started = time.perf_counter()
    if progress:
        console.print(f"[kiln] building {TINY_LLAMA} (once; cached afterwards) into {out_dir}")

    train_docs = calibration_texts()
    tokenizer = train_tokenizer(train_docs, recipe.vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(recipe))

    with _deterministic(recipe.seed, recipe.threads):
        model = _new_model(recipe)
        blocks = _token_blocks(tokenizer, train_docs, recipe.seq_len)
        final_loss = _train(model, blocks, recipe, console if progress else None)
        heldout_ppl = _perplexity(model, tokenizer, heldout_texts(), recipe.max_position_embeddings)
    from kiln.models.loading import hf_progress

    with hf_progress(progress):
        model.save_pretrained(out_dir)

    record = {
        "name": TINY_LLAMA,
        **_key_material(recipe),
        "corpus_modules": corpus_files(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens_seen": recipe.train_steps * recipe.batch_size * recipe.seq_len,
        "final_train_loss": round(final_loss, 6),
        "heldout_perplexity": round(heldout_ppl, 4),
    }
    _write_json(out_dir / BUILD_RECORD, record)
    _make_readable(out_dir)
    if progress:
        console.print(
            f"[kiln] {TINY_LLAMA}: {record['parameters']:,} parameters, held-out perplexity {heldout_ppl:.1f} "
            f"(vocabulary {recipe.vocab_size}), built in {time.perf_counter() - started:.0f} s"
        )


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``texts``; encoding adds ``<s>`` in front, like Llama's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def tokenizer_config(recipe: TinyLlamaRecipe = DEFAULT_RECIPE) -> dict[str, Any]:
    """tokenizer_config.json: a plain PreTrainedTokenizerFast over tokenizer.json (old and new transformers)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "model_max_length": recipe.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }


def _new_model(recipe: TinyLlamaRecipe) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        rms_norm_eps=recipe.rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def _token_blocks(tokenizer: Tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """The documents as one stream (``<s> doc </s>`` each, in order), cut into [n, seq_len] blocks."""
    import torch

    eos_id = tokenizer.token_to_id(EOS)
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        stream.extend(encoding.ids)
        stream.append(eos_id)
    usable = len(stream) // seq_len * seq_len
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, seq_len)


def _learning_rate(step: int, recipe: TinyLlamaRecipe) -> float:
    """Linear warm-up, then cosine decay to the minimum."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.train_steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.min_learning_rate + (recipe.learning_rate - recipe.min_learning_rate) * cosine


def _batch_order(n_blocks: int, recipe: TinyLlamaRecipe) -> Iterator[Any]:
    """Block indices for each step: a seeded permutation per pass over the data."""
    import torch

    generator = torch.Generator().manual_seed(recipe.seed)
    while True:
        order = torch.randperm(n_blocks, generator=generator)
        for start in range(0, n_blocks - recipe.batch_size + 1, recipe.batch_size):
            yield order[start : start + recipe.batch_size]


def _train(model: Any, blocks: torch.Tensor, recipe: TinyLlamaRecipe, console: Console | None) -> float:
    """A few hundred AdamW steps; returns the mean loss of the last 10% of steps."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if len(blocks) < recipe.batch_size:
        raise KilnError(f"the tiny-model corpus is too small: {len(blocks)} blocks of {recipe.seq_len} tokens")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate, betas=(0.9, 0.95), eps=1e-8,
    )
    model.train()
    tail = max(1, recipe.train_steps // 10)
    tail_losses: list[float] = []
    columns = (TextColumn("[kiln] training tiny-llama"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=console is None, transient=False) as bar:
        task = bar.add_task("train", total=recipe.train_steps, loss="-")
        batches = _batch_order(len(blocks), recipe)
        for step in range(recipe.train_steps):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, recipe)
            batch = blocks[next(batches)]
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            value = loss.item()
            if step >= recipe.train_steps - tail:
                tail_losses.append(value)
            bar.update(task, advance=1, loss=f"{value:.3f}")
    model.eval()
    return sum(tail_losses) / len(tail_losses)


def _perplexity(model: Any, tokenizer: Tokenizer, docs: list[str], max_tokens: int) -> float:
    """Token-weighted perplexity over documents (each ``<s> doc``, cut at ``max_tokens``)."""
    import torch

    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for encoding in tokenizer.encode_batch(docs):
            ids = torch.tensor([encoding.ids[:max_tokens]])
            if ids.shape[1] < 2:
                continue
            loss = model(input_ids=ids, labels=ids).loss
            count = ids.shape[1] - 1
            total_nll += loss.item() * count
            total_tokens += count
    return math.exp(total_nll / max(1, total_tokens))


@contextlib.contextmanager
def _deterministic(seed: int, threads: int) -> Iterator[None]:
    """Seeded RNG, deterministic algorithms and a fixed thread count, all restored on exit."""
    import torch

    old_threads = torch.get_num_threads()
    old_deterministic = torch.are_deterministic_algorithms_enabled()
    old_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(old_deterministic, warn_only=old_warn_only)
            torch.set_num_threads(old_threads)


def _make_readable(directory: pathlib.Path) -> None:
    """Plain permissions (temporary directories and some writers use owner-only modes): 755 / 644."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _console() -> Console:
    from rich.console import Console

    return Console(stderr=True)
