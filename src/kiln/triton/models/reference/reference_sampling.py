"""Per-request sampling for kiln's reference ``tensorrt_llm`` runtime (see model.py's docstring, "Sampling").

Shipped beside the reference ``model.py`` (the backend puts the version directory on ``sys.path``); it imports
torch and ``kiln_triton_utils`` only, never kiln.
"""

import math
import secrets
from dataclasses import dataclass, field

import torch
from kiln_triton_utils import RequestError


@dataclass
class Sampling:
    """Per-request decoding settings, applied by ``KilnSampler`` inside the manager's step."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    end_id: int = -1
    prompt_len: int = 0
    bad_words: list = field(default_factory=list)
    want_logprobs: bool = False
    bias: torch.Tensor | None = None  # embedding_bias: added to the logits before anything else
    logprobs: list = field(default_factory=list)
    generator: torch.Generator | None = None
    error: str | None = None  # set when processing this request's logits failed

    def __post_init__(self):
        if not self.greedy and self.generator is None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))

    @property
    def touches_logits(self):
        """False when the row can be left to the manager's plain argmax."""
        return (not self.greedy or self.want_logprobs or bool(self.bad_words) or self.min_tokens > 0
                or self.bias is not None)


def make_sampling(temperature=None, top_k=None, top_p=None, seed=None, **kwargs):
    """Validate sampling inputs and decide greedy vs sampled with TensorRT-LLM's rules."""
    t = 1.0 if temperature is None else float(temperature)
    k = 0 if top_k is None else int(top_k)
    p = 0.0 if top_p is None else float(top_p)
    if not math.isfinite(t) or t < 0:
        raise RequestError(f"temperature must be >= 0, got {t}")
    if k < 0:
        raise RequestError(f"top_k must be >= 0, got {k}")
    if not 0.0 <= p <= 1.0:
        raise RequestError(f"top_p must be in [0, 1], got {p}")
    greedy = t == 0.0 or k == 1 or (k == 0 and p == 0.0)
    return Sampling(greedy=greedy, temperature=t, top_k=k, top_p=p, seed=seed, **kwargs)


def bad_word_mask_ids(context, bad_words):
    """Token ids to forbid next: the last token of each bad word whose other tokens end ``context``."""
    banned = []
    for word in bad_words:
        head = word[:-1]
        if not head or (len(context) >= len(head) and list(context[-len(head) :]) == head):
            banned.append(word[-1])
    return banned


def process_row(scores, spec, context):
    """Apply one request's settings to its logits row (in place) so that argmax picks its next token."""
    s = scores
    if spec.bias is not None:
        n = min(s.numel(), spec.bias.numel())
        s[:n] += spec.bias[:n]
    if spec.bad_words:
        banned = bad_word_mask_ids(context, spec.bad_words)
        if banned:
            s[torch.tensor(banned, dtype=torch.long)] = -math.inf
    generated = len(context) - spec.prompt_len
    if spec.min_tokens > 0 and generated < spec.min_tokens and 0 <= spec.end_id < s.numel():
        s[spec.end_id] = -math.inf
    if spec.greedy:
        if spec.want_logprobs:
            spec.logprobs.append(float(torch.log_softmax(s, dim=-1)[int(torch.argmax(s))]))
        return
    s = s / spec.temperature
    if 0 < spec.top_k < s.numel():
        kth = torch.topk(s, spec.top_k).values[-1]
        s = s.masked_fill(s < kth, -math.inf)
    if 0.0 < spec.top_p < 1.0:
        ordered, order = torch.sort(s, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        drop = before >= spec.top_p
        drop[0] = False
        s = s.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
    logp = torch.log_softmax(s, dim=-1)
    uniform = torch.rand(s.shape, generator=spec.generator, dtype=torch.float32).clamp_(1e-20, 1.0 - 1e-7)
    choice = int(torch.argmax(logp - torch.log(-torch.log(uniform))))  # Gumbel-max: one draw from softmax(s)
    if spec.want_logprobs:
        spec.logprobs.append(float(logp[choice]))
    scores.fill_(-math.inf)
    scores[choice] = 0.0
