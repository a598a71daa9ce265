"""Chat templates: a model's own Jinja template turns chat messages into the prompt text.

The template is the tokenizer's: ``chat_template.jinja`` in the tokenizer directory, else the ``chat_template``
of ``tokenizer_config.json`` (a string, or a list of named templates, of which ``default`` is used). It is
rendered as transformers' ``apply_chat_template`` renders it: a sandboxed Jinja environment with ``trim_blocks``
and ``lstrip_blocks``, the loop-controls extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` that
keeps non-ASCII text, with ``messages``, ``add_generation_prompt=True`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables.

A model without a template cannot serve chat: :func:`load_chat_template` returns None and the server answers
chat requests with a 400 that says so.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template failed to render these messages (its own raise_exception, or a Jinja error)."""


def _token(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        from jinja2 import ext
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.origin = origin
        self.special_tokens = special_tokens
        self._template = env.from_string(source)

    def render(self, messages: list[dict[str, Any]]) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template ({self.origin}) refused these messages: {exc}") from None


def load_chat_template(tokenizer_dir: Path | None) -> ChatTemplate | None:
    """The tokenizer directory's chat template, or None when it has none (or there is no directory)."""
    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return None
    tokenizer_dir = Path(tokenizer_dir)
    config: dict[str, Any] = {}
    config_path = tokenizer_dir / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    special = {name: tok for name in _SPECIAL if (tok := _token(config.get(name))) is not None}
    file = tokenizer_dir / TEMPLATE_FILE
    if file.is_file():
        return ChatTemplate(file.read_text(encoding="utf-8"), special, str(file))
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(source, str) and source.strip():
        return ChatTemplate(source, special, f"{config_path} chat_template")
    return None
