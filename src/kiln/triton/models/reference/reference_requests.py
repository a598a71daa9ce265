"""The reference runtime's requests (a sibling of its model.py, shipped with it into the model directory): a Triton
request's batch items as manager sequences, its stop/bad word lists in upstream's [batch, 2, L] layout, per-item
scalar inputs and the model's default end/pad ids."""

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np
from kiln_triton_utils import RequestError, input_array
from reference_sampling import Sampling


def word_lists(array, batch_size):
    """Decode [batch, 2, L] stop/bad word tensors into, per item, a list of token-id lists."""
    if array is None:
        return [[] for _ in range(batch_size)]
    array = np.asarray(array)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3 or array.shape[1] != 2:
        raise RequestError(f"word lists must be [batch, 2, L] (ids, offsets), got shape {array.shape}")
    if array.shape[0] == 1 and batch_size > 1:
        array = np.repeat(array, batch_size, axis=0)
    out = []
    for ids, offsets in array[:batch_size]:
        words, start = [], 0
        for end in offsets:
            end = int(end)
            if end < 0:
                break
            if end <= start or end > len(ids):
                raise RequestError(f"word list offsets must increase within the ids row, got {offsets.tolist()}")
            words.append([int(t) for t in ids[start:end]])
            start = end
        out.append(words)
    return out


@dataclass
class Sequence:
    """One batch item of a Triton request, as one request in the manager."""

    rid: str
    prompt: list
    max_new: int
    end_id: int
    pad_id: int
    sampling: Sampling
    stop_words: list = field(default_factory=list)
    draft: list | None = None
    tokens: list = field(default_factory=list)
    streamed: int = 0
    done: bool = False
    item_final: bool = False  # per-item responses: this item's last response was sent

    def update(self, generated, finished):
        """Take the manager's tokens so far; apply end id, draft verification and stop words. Returns done."""
        toks = list(generated)
        checked = len(self.tokens)
        if finished and toks and toks[-1] == self.end_id:
            toks.pop()
        if self.draft is not None:
            for i, tok in enumerate(toks):
                if i >= len(self.draft) or tok != self.draft[i]:
                    toks, finished = toks[: i + 1], True
                    break
        for i in range(checked, len(toks)):
            if any(len(w) <= i + 1 and toks[i + 1 - len(w) : i + 1] == w for w in self.stop_words):
                toks, finished = toks[: i + 1], True
                break
        self.tokens = toks
        self.done = self.done or finished
        return self.done


@dataclass
class Job:
    """One Triton request: its sender, options and batch items."""

    request: object
    sender: object
    streaming: bool
    exclude_input: bool
    want_logprobs: bool
    seqs: list
    want_counts: tuple = (False, False)  # return_num_input_tokens, return_num_output_tokens
    triton_id: str = ""
    per_item: bool = False  # batch > 1 (decoupled): one response stream per batch item, each with batch_index
    want_index: bool = False  # batch_index requested (upstream sends it only when batch > 1)
    started: float = field(default_factory=time.monotonic)
    finished: bool = False


def _scalars(request, name, batch_size, cast, *aliases):
    """Per-item values of an optional [batch, 1] input (None when absent)."""
    for key in (name,) + aliases:
        array = input_array(request, key)
        if array is not None:
            flat = np.asarray(array).reshape(-1)
            if flat.size == 1:
                flat = np.repeat(flat, batch_size)
            if flat.size != batch_size:
                raise RequestError(f"{key} must hold one value per batch item ({batch_size}), got {array.shape}")
            return [cast(v) for v in flat]
    return [None] * batch_size


def _requested(request, name):
    """Whether the client asked for output ``name`` (every output when the stub cannot say)."""
    try:
        names = request.requested_output_names()
    except Exception:
        return True
    return not names or name in names


def _request_id(request):
    try:
        return request.request_id() or ""
    except Exception:
        return ""


def _default_ids(model_dir, config):
    """(end_id, pad_id) defaults from generation_config.json / the model config."""
    end = pad = None
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            gen = json.load(fh)
        end, pad = gen.get("eos_token_id"), gen.get("pad_token_id")
    end = end if end is not None else getattr(config, "eos_token_id", None)
    pad = pad if pad is not None else getattr(config, "pad_token_id", None)
    end = end[0] if isinstance(end, list) else end
    pad = pad[0] if isinstance(pad, list) else pad
    end = -1 if end is None else int(end)
    return end, end if pad is None else int(pad)
