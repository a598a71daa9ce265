"""Find, check and load the model a recipe names.

Three kinds of source (``model.source``):

- ``builtin:tiny-llama``: made locally by :mod:`kiln.models.tiny` and cached;
- a local Hugging Face directory (relative paths resolve against the working directory);
- ``hf:org/name[@revision]``: downloaded with ``huggingface_hub.snapshot_download`` (weights as
  safetensors, config and tokenizer files only).

:func:`check_model_dir` reads only small files and safetensors *headers*, so a wrong path, a corrupt
file or an unsupported architecture is reported as an :class:`~kiln.util.errors.InputError` before any
heavy work. :func:`load_model` loads the weights directly in the recipe dtype (never through float32:
that doubles the memory calibration needs, a common cause of out-of-memory upstream).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

from kiln.recipe.schema import BUILTIN_PREFIX, HF_PREFIX
from kiln.util.errors import InputError

if TYPE_CHECKING:  # heavy imports stay inside functions
    import torch

#: Architectures (``config.json`` ``architectures[0]``) kiln quantizes and exports, and the ModelOpt
#: TensorRT-LLM decoder type each is exported as. Llama-family decoders only: these are the ones the
#: ModelOpt TensorRT-LLM exporter writes as TensorRT-LLM ``LlamaForCausalLM`` checkpoints.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}

#: Files that make a tokenizer loadable (any one of these sets).
TOKENIZER_FILES: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
)

#: What a ``snapshot_download`` fetches: no pickled weights, no other formats.
HF_ALLOW_PATTERNS: tuple[str, ...] = (
    "*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt",
)  # fmt: skip

_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class ModelInfo:
    """What :func:`check_model_dir` found: enough to plan the work without loading weights."""

    path: Path
    architecture: str
    decoder_type: str
    config: dict[str, Any]
    weight_files: tuple[Path, ...]
    parameters: int
    stored_dtype: Optional[str]

    @property
    def num_attention_heads(self) -> int:
        return int(self.config.get("num_attention_heads", 0))

    @property
    def num_key_value_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config.get("num_hidden_layers", 0))


# --------------------------------------------------------------------------------------------- resolve


def split_hf_id(source: str) -> tuple[str, Optional[str]]:
    """``hf:org/name@rev`` → (``org/name``, ``rev``); the revision is None when absent."""
    ref = source[len(HF_PREFIX):] if source.startswith(HF_PREFIX) else source
    repo_id, _, revision = ref.partition("@")
    return repo_id, (revision or None)


def resolve_model_dir(source: str, trust_remote_code: bool = False, key: str = "model.source",
                      progress: bool = True) -> Path:
    """The local directory of a model source (building or downloading it first when needed).

    A hub source's revision (``hf:org/name@rev``: branch, tag or commit) is passed to the download; its
    Python files are fetched only with ``trust_remote_code``. ``key`` names the recipe key the source came
    from, for error messages. Raises InputError when a local path does not exist or is not a directory, or
    a hub download fails.
    """
    if source.startswith(BUILTIN_PREFIX):
        from kiln.models.tiny import TINY_LLAMA, ensure_tiny_llama

        if source != TINY_LLAMA:
            raise InputError(f"{key}: unknown built-in model {source!r}; the built-in model is {TINY_LLAMA}")
        return ensure_tiny_llama(progress=progress)
    if source.startswith(HF_PREFIX):
        return _download(source, key, trust_remote_code)
    path = Path(source).expanduser()
    if not path.exists():
        raise InputError(f"{key}: model directory {source!r} not found (looked for {path.absolute()}); "
                         "give a Hugging Face model directory, hf:org/name or builtin:tiny-llama")
    if not path.is_dir():
        raise InputError(f"{key}: {source!r} is a file, not a model directory; give the directory that holds "
                         "config.json, the *.safetensors weights and the tokenizer")
    return path.absolute()


def _download(source: str, key: str, trust_remote_code: bool) -> Path:
    """Download (or find in the Hugging Face cache) a hub model; any failure is an InputError."""
    from huggingface_hub import snapshot_download

    repo_id, revision = split_hf_id(source)
    patterns = list(HF_ALLOW_PATTERNS) + (["*.py"] if trust_remote_code else [])
    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - network, auth, missing repo/revision: all the user's to fix
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise InputError(
            f"{key}: cannot download {repo_id}" + (f" at revision {revision}" if revision else "")
            + f" ({reason}). Check the name and your network; for gated models log in (huggingface-cli login "
            "or HF_TOKEN); or download the model yourself and set the key to its local directory."
        ) from None


# --------------------------------------------------------------------------------------------- check


def read_config(path: Path, key: str = "model.source") -> dict[str, Any]:
    """config.json of a model directory, parsed; InputError if missing or unreadable."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{key}: {path} has no config.json; is it a Hugging Face model directory?")
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{key}: cannot read {cfg_path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{key}: {cfg_path} is not valid JSON ({exc}); re-download or re-export the model") from None
    if not isinstance(data, dict):
        raise InputError(f"{key}: {cfg_path} must hold a JSON object, not {type(data).__name__}")
    return data


def architecture_of(config: dict[str, Any], where: Path, key: str = "model.source") -> tuple[str, str]:
    """(architecture, ModelOpt decoder type); InputError for architectures kiln does not support."""
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if arch is None:
        raise InputError(f"{key}: {where / 'config.json'} names no architecture (`architectures` is missing); "
                         f"kiln supports {supported}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise InputError(f"{key}: architecture {arch} is not supported; kiln quantizes and exports Llama-family "
                         f"decoders that ModelOpt's TensorRT-LLM exporter writes as Llama checkpoints: {supported}")
    return arch, SUPPORTED_ARCHITECTURES[arch]


def weight_files(path: Path, key: str = "model.source") -> tuple[Path, ...]:
    """The safetensors weight files of a model directory (all shards of an index); InputError if none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{key}: cannot read the shard index {index}: {exc}") from None
        files = tuple(path / name for name in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"{key}: {index.name} lists shards that are missing from {path}: "
                             + ", ".join(missing[:5]) + ("…" if len(missing) > 5 else ""))
        return files
    files = tuple(sorted(path.glob("*.safetensors")))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise InputError(f"{key}: {path} has PyTorch pickle weights (*.bin) but no *.safetensors; kiln loads "
                         "safetensors only (pickles can run code). Convert with save_pretrained(..., "
                         "safe_serialization=True) or use the hub's safetensors revision")
    raise InputError(f"{key}: {path} has no *.safetensors weights")


def count_parameters(files: tuple[Path, ...], key: str = "model.source") -> tuple[int, Optional[str]]:
    """Open every safetensors header (not the data): (total parameters, the most common dtype).

    A truncated or corrupt file is an InputError naming it.
    """
    from safetensors import safe_open

    total = 0
    dtypes: dict[str, int] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    sl = handle.get_slice(name)
                    n = 1
                    for d in sl.get_shape():
                        n *= int(d)
                    total += n
                    dt = str(sl.get_dtype())
                    dtypes[dt] = dtypes.get(dt, 0) + n
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ... : all mean "bad file"
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(f"{key}: weight file {file} is corrupt or unreadable ({reason}); "
                             "re-download or re-export it") from None
    common = max(dtypes, key=lambda d: dtypes[d]) if dtypes else None
    return total, _safetensors_dtype_name(common)


def _safetensors_dtype_name(dt: Optional[str]) -> Optional[str]:
    return {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}.get(dt or "")


def check_tokenizer_dir(path: Path, key: str = "model.source") -> None:
    """InputError unless ``path`` holds the files of a loadable tokenizer."""
    if not any(all((path / f).is_file() for f in group) for group in TOKENIZER_FILES):
        wanted = " or ".join("+".join(g) for g in TOKENIZER_FILES)
        raise InputError(f"{key}: no tokenizer in {path} (looked for {wanted}); copy the tokenizer files next to "
                         "the model or set model.tokenizer")


def check_model_dir(path: Path, key: str = "model.source", tokenizer_dir: Optional[Path] = None) -> ModelInfo:
    """Everything that can be checked without loading weights: config.json, architecture, safetensors
    headers, tokenizer files. Raises InputError naming the file and the fix."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{key}: model directory {path} not found")
    config = read_config(path, key)
    arch, decoder = architecture_of(config, path, key)
    files = weight_files(path, key)
    params, stored = count_parameters(files, key)
    if tokenizer_dir is None:
        check_tokenizer_dir(path, key)
    else:
        check_tokenizer_dir(tokenizer_dir, "model.tokenizer")
    return ModelInfo(path, arch, decoder, config, files, params, stored)


# --------------------------------------------------------------------------------------------- dtype/load


def config_dtype(config: dict[str, Any]) -> Optional[str]:
    """The dtype a config.json names (``torch_dtype`` in transformers 4, ``dtype`` in 5), if a known one."""
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
            return value.replace("torch.", "")
    return None


def resolve_dtype(recipe_dtype: str, config: dict[str, Any]) -> str:
    """The dtype to load in: the recipe's, or for ``auto`` the checkpoint's (float16 if it names none)."""
    if recipe_dtype != "auto":
        return recipe_dtype
    return config_dtype(config) or "float16"


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


@contextlib.contextmanager
def hf_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars (e.g. "Writing model shards") for the duration."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def hf_progress_off() -> contextlib.AbstractContextManager[None]:
    """Silence transformers' own progress bars (kiln shows its own) for the duration."""
    return hf_progress(False)


def load_model(path: Path, dtype: str, trust_remote_code: bool = False) -> Any:
    """The causal LM in ``path``, loaded straight into ``dtype`` (a resolved name, not ``auto``), eval mode,
    on the CPU (or the first CUDA device when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        with hf_progress_off():
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype(dtype), low_cpu_mem_usage=True, trust_remote_code=trust_remote_code,
                device_map=device if device == "cuda" else None,
            )
    except (OSError, ValueError) as exc:
        raise InputError(f"model.source: cannot load the model in {path}: {str(exc).splitlines()[0]}") from None
    return model.eval()


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer in ``path``, with a pad token (the EOS token when it defines none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise InputError(f"model.tokenizer: cannot load the tokenizer in {path}: {str(exc).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_tokenizer(tokenizer: Any, path: Path | str) -> None:
    """``save_pretrained`` without the truncation and padding a fast tokenizer keeps from its last call (kiln's
    calibration tokenizes with ``truncation=True, max_length=…``, and tokenizer.json would otherwise tell every
    ``tokenizers`` user to cut prompts at the calibration length)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()
    tokenizer.save_pretrained(str(path))


# --------------------------------------------------------------------------------------------- hashing


def model_source_hash(source: str, key: str = "model.source") -> str:
    """A content hash of a model source for the step fingerprint, cheap enough to run every time.

    - built-in: the tiny model's cache key (builder version, recipe, corpus, library versions);
    - hub: the id and revision (a branch name is as stable as the branch; pin a commit to be exact);
    - local directory: config.json, generation_config.json and tokenizer files in full, plus each
      safetensors file's header (tensor names, dtypes, shapes, offsets), size and modification time, and each
      pickled weights file's (``.bin``, ``.pt``, ``.pth``) size and modification time — rewriting weights changes
      at least the latter without reading gigabytes on every run.
    """
    if source.startswith(BUILTIN_PREFIX):
        from kiln.models.tiny import tiny_llama_key

        return "sha256:" + hashlib.sha256(f"{source}\0{tiny_llama_key()}".encode()).hexdigest()
    if source.startswith(HF_PREFIX):
        repo_id, revision = split_hf_id(source)
        return "sha256:" + hashlib.sha256(f"hf\0{repo_id}\0{revision or 'main'}".encode()).hexdigest()
    path = resolve_model_dir(source, key=key)
    digest = hashlib.sha256()
    small = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".model", ".txt", ".tiktoken"))
    for file in small:
        digest.update(file.name.encode() + b"\0")
        try:
            digest.update(file.read_bytes())
        except OSError as exc:
            raise InputError(f"{key}: cannot read {file}: {exc}") from None
    for file in sorted(path.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        digest.update(_safetensors_header(file))
    for file in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".bin", ".pt", ".pth")):
        stat = file.stat()  # pickled weights (pytorch_model.bin, as many EAGLE3 heads ship): name, size and time
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return "sha256:" + digest.hexdigest()


def _safetensors_header(file: Path) -> bytes:
    """The JSON header of a safetensors file (8-byte little-endian length, then the header)."""
    with file.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            return b""
        size = int.from_bytes(raw, "little")
        return handle.read(min(size, 100_000_000))
