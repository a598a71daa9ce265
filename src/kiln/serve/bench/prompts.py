"""Prompts for ``kiln bench``: synthetic ones of a given length, or read from a file (with expected outputs)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.util.errors import InputError

_WORDS = (
    "the of and to in is was for on that with as by at from his her an which are this be or have had not "
    "one their were all but been they has more when will there would who its into time can only other new "
    "some could these two may first then do any like my now over such our man me even most made after also "
    "did many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go "
    "came right used take three small place part found light water river city house music field story word"
).split()


def synthetic_prompts(n: int, input_len: int, seed: int = 0, tokenizer: Any = None) -> list[str]:
    """``n`` distinct prompts of ``input_len`` common English words each, reproducible from ``seed``; with the
    served model's ``tokenizer`` (a ``tokenizers.Tokenizer``), of ``input_len`` tokens each (special tokens the
    server adds, such as BOS, not counted), as AIPerf's and guidellm's lengths are.

    Without a tokenizer, length is in words, which the server's tokenizer turns into roughly as many tokens
    (about one per common word for byte-level BPE vocabularies; more for small ones such as the built-in tiny
    model's). Each prompt starts with its index, so no two share a prefix beyond it (no accidental KV-cache reuse).
    """
    if n < 1 or input_len < 1:
        raise InputError(f"synthetic prompts need n >= 1 and input_len >= 1, got n={n}, input_len={input_len}")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = [f"item{i}"] + [rng.choice(_WORDS) for _ in range(input_len - 1)]
        text = " ".join(words)
        if tokenizer is not None:
            while len(ids := tokenizer.encode(text, add_special_tokens=False).ids) < input_len:
                text += " " + rng.choice(_WORDS)
            text = tokenizer.decode(ids[:input_len])
        prompts.append(text)
    return prompts


@dataclass(frozen=True)
class PromptSet:
    """Prompts read from a file, and the expected outputs the file gives for some of them (else ``None``)."""

    prompts: tuple[str, ...]
    expected: dict[str, str] | None = None


def load_prompts(path: Path) -> PromptSet:
    """Read prompts from ``path``.

    Formats: ``.jsonl`` (one JSON string per line, or an object with ``prompt`` — or ``text_input`` — and
    optionally ``expected``), ``.json`` (a list of strings or such objects, or an object mapping each prompt to
    its expected text), anything else plain text with one prompt per non-empty line.

    Raises:
        InputError: the file is missing, unreadable, malformed, or holds no prompt; the message names the line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read prompts file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"prompts file {path} is not UTF-8 text: {exc}") from exc
    prompts: list[str] = []
    expected: dict[str, str] = {}

    def add(item: Any, where: str) -> None:
        if isinstance(item, str):
            prompts.append(item)
            return
        if isinstance(item, dict):
            prompt = item.get("prompt", item.get("text_input"))
            if not isinstance(prompt, str):
                raise InputError(f"{where}: an object needs a string 'prompt' (or 'text_input') field")
            prompts.append(prompt)
            ref = item.get("expected")
            if ref is not None:
                if not isinstance(ref, str):
                    raise InputError(f"{where}: 'expected' must be a string")
                expected[prompt] = ref
            return
        raise InputError(f"{where}: expected a string or an object with 'prompt', got {type(item).__name__}")

    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    add(json.loads(line), f"{path}:{no}")
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{no}: not valid JSON ({exc.msg})") from exc
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from exc
        if isinstance(data, dict):
            for prompt, ref in data.items():
                if not isinstance(ref, str):
                    raise InputError(f"{path}: the expected text for prompt {prompt[:40]!r} must be a string")
                prompts.append(prompt)
                expected[prompt] = ref
        elif isinstance(data, list):
            for i, item in enumerate(data):
                add(item, f"{path}[{i}]")
        else:
            raise InputError(f"{path}: expected a list of prompts or an object mapping prompts to expected text")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"prompts file {path} holds no prompt")
    return PromptSet(tuple(prompts), expected or None)
