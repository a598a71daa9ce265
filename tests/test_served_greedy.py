"""The claim the reference target exists for, in the fast tier: what kiln serves is the *quantized* model.

The default recipe (the trained built-in tiny Llama, INT4 AWQ) is built once by the real pipeline and served by a
real tritonserver (conftest.default_build / default_server). Its greedy output, through the ensemble over HTTP
and gRPC streaming, must equal Hugging Face ``generate`` on the checkpoint with the ModelOpt state restored, and
must differ from ``generate`` on the unquantized checkpoint for some prompt. That second part is asserted first,
so the test cannot pass vacuously: a runtime that skipped ``mto.restore`` (serving the unquantized weights) fails
it. Not marked ``integration``: it runs in ``make test-unit``.
"""

from __future__ import annotations

from kiln.serve.client import generate_http, generate_stream

# Two prompts on which INT4-AWQ and the unquantized model (the built-in model as trained) part ways within MAX_TOKENS
# greedy tokens (at the 3rd and the 10th token), and one on which they agree; the test checks the first kind exists.
PROMPTS = ["class Config:\n    \"\"\"", "    return self.", "# Copyright"]
MAX_TOKENS = 16


def test_served_greedy_output_is_the_quantized_models(default_server, hf_greedy):
    quantized = {p: hf_greedy(p, MAX_TOKENS) for p in PROMPTS}
    unquantized = {p: hf_greedy(p, MAX_TOKENS, quantized=False) for p in PROMPTS}
    differing = [p for p in PROMPTS if quantized[p] != unquantized[p]]
    assert len(differing) >= 2, (
        "precondition: quantization must change the greedy output of some prompts, or this test could not tell "
        f"the quantized model from the unquantized one; choose other prompts or a longer MAX_TOKENS ({unquantized})"
    )
    urls = default_server.urls()
    served = {p: generate_http(urls["http"], p, MAX_TOKENS) for p in PROMPTS}
    streamed = {p: "".join(generate_stream(urls["grpc"], p, MAX_TOKENS)) for p in differing}
    assert served == quantized, "the server's greedy output is not the quantized model's"
    assert streamed == {p: quantized[p] for p in differing}
