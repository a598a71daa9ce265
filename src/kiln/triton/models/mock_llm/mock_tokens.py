"""The token algorithm of kiln bench's mock LLM: the one implementation, used by the model and by kiln.

The mock's ``model.py`` imports this file from its version directory (kiln ships it beside the model);
kiln imports it as ``kiln.triton.models.mock_llm.mock_tokens`` to know what the mock will answer
(``kiln.serve.bench.mock_expected_text``). Standard library only: no kiln, no ``triton_python_backend_utils``.

Token ``i`` of a prompt is the first two bytes (little-endian) of ``sha256(sha256(prompt) + i as 4 LE bytes)``,
and its text is ``f" {id:04x}"``: deterministic, distinct per prompt, and cheap.
"""

import hashlib

#: A prompt starting with these bytes gets an error response (to exercise error counting).
FAIL_PREFIX = b"kiln-mock-fail"


def token_ids(prompt_bytes, n):
    """The first ``n`` token ids the mock generates for ``prompt_bytes``."""
    seed = hashlib.sha256(prompt_bytes).digest()
    return [int.from_bytes(hashlib.sha256(seed + i.to_bytes(4, "little")).digest()[:2], "little") for i in range(n)]


def token_text(token_id):
    """The text of one token id."""
    return f" {token_id:04x}"


def tokens_text(ids):
    """The text of a run of token ids (what one response carries)."""
    return "".join(token_text(int(t)) for t in ids)


def expected_text(prompt, n):
    """The whole text the mock streams for ``prompt`` (str or UTF-8 bytes) with ``max_tokens = n``."""
    prompt_bytes = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    return tokens_text(token_ids(prompt_bytes, max(n, 0)))
