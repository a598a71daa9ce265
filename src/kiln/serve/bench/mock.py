"""kiln bench's mock LLM: a repository writer for it and the text it answers.

The model itself is a real Triton Python model shipped with kiln (``kiln/triton/models/mock_llm/model.py``): a
deterministic stand-in for an LLM with the ensemble's tensor contract, to test the bench and to measure the
client and the serving stack without a model. Its token algorithm has one home,
:mod:`kiln.triton.models.mock_llm.mock_tokens`, which the served model and :func:`mock_expected_text` share.
Configs are written as real ``ModelConfig`` protobufs, like the rest of kiln's repositories.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.triton.models.mock_llm.mock_tokens import expected_text
from kiln.triton.repository import base_config, cpu_instances, install_python_model, render, set_parameters
from kiln.triton.upstream import TensorSpec

#: The kiln model directory (under kiln/triton/models) that holds the mock.
MOCK_MODEL_KIND = "mock_llm"
MOCK_MAX_BATCH_SIZE = 64

_T = TensorSpec
_LLM_INPUTS = [_T("text_input", "TYPE_STRING", (1,)), _T("max_tokens", "TYPE_INT32", (1,)),
               _T("stream", "TYPE_BOOL", (1,), optional=True)]
_LLM_OUTPUTS = [_T("text_output", "TYPE_STRING", (-1,))]
_COUNT_INPUT = _T("return_num_output_tokens", "TYPE_BOOL", (1,), optional=True)
_COUNT_OUTPUT = _T("num_output_tokens", "TYPE_INT32", (1,))
_STEP_TENSORS: dict[str, tuple[list[TensorSpec], list[TensorSpec]]] = {
    "pre": ([_T("text_input", "TYPE_STRING", (1,))],
            [_T("input_ids", "TYPE_INT32", (-1,)), _T("input_lengths", "TYPE_INT32", (1,))]),
    "generate": ([_T("input_ids", "TYPE_INT32", (-1,)), _T("input_lengths", "TYPE_INT32", (1,)),
                  _T("request_output_len", "TYPE_INT32", (1,)), _T("streaming", "TYPE_BOOL", (1,), optional=True)],
                 [_T("output_ids", "TYPE_INT32", (-1,))]),
    "post": ([_T("output_ids", "TYPE_INT32", (-1,))], [_T("text_output", "TYPE_STRING", (-1,))]),
}
#: The mock ensemble's steps: (role, input_map, output_map), model tensor -> ensemble tensor.
_ENSEMBLE_STEPS = (
    ("pre", {"text_input": "text_input"}, {"input_ids": "_ids", "input_lengths": "_lengths"}),
    ("generate", {"input_ids": "_ids", "input_lengths": "_lengths", "request_output_len": "max_tokens",
                  "streaming": "stream"}, {"output_ids": "_out_ids"}),
    ("post", {"output_ids": "_out_ids"}, {"text_output": "text_output"}),
)


def mock_expected_text(prompt: str, output_len: int) -> str:
    """The text the mock model streams for ``prompt`` with ``max_tokens=output_len`` (the model's own code)."""
    return expected_text(prompt, output_len)


def _python_model(root: Path, name: str, inputs: list[TensorSpec], outputs: list[TensorSpec], *, decoupled: bool,
                  instances: int, params: dict[str, Any]) -> None:
    config = base_config(name, MOCK_MAX_BATCH_SIZE, inputs, outputs, backend="python")
    if decoupled:
        config.model_transaction_policy.decoupled = True
    cpu_instances(config, instances)
    set_parameters(config, params)
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(render(config), encoding="utf-8")
    install_python_model(MOCK_MODEL_KIND, folder)


def write_mock_repository(
    root: Path,
    *,
    name: str = "mock_llm",
    token_delay_ms: float = 0.0,
    compute_ms: float = 0.0,
    token_counts: bool = False,
    ensemble: bool = False,
    instances: int = 1,
    final_with_last: bool = False,
) -> Path:
    """Write (or add to) a Triton repository with kiln bench's deterministic mock LLM; returns ``root``.

    The mock streams ``max_tokens`` tokens, each ``f" {id:04x}"`` for an id hashed from the prompt (see
    :func:`mock_expected_text`), ends every request with a flags-only final response (as decoupled BLS
    models do), and sleeps ``token_delay_ms`` before each token (requests then run in their own threads).
    A prompt starting with ``kiln-mock-fail`` gets an error response instead (to exercise error counting).
    ``final_with_last`` marks the last token's response final instead (one message fewer per request, as the
    ``tensorrt_llm`` backend does). ``instances`` sets each Python model's instance count.

    ``ensemble=False``: one decoupled Python model ``name`` with the ensemble's contract (``text_input``,
    ``max_tokens``, ``stream`` → ``text_output``; with ``token_counts`` also ``return_num_output_tokens`` →
    ``num_output_tokens``). ``ensemble=True``: an ensemble ``name`` of three Python models,
    ``<name>_pre`` (text → byte ids), ``<name>_generate`` (takes exactly ``compute_ms`` per request, then
    streams ids) and ``<name>_post`` (ids → text), the same shape as upstream's pre → tensorrt_llm → post.
    """
    root = Path(root)
    timing = {"token_delay_ms": token_delay_ms, "compute_ms": compute_ms, "final_with_last": final_with_last}
    if not ensemble:
        inputs = _LLM_INPUTS + ([_COUNT_INPUT] if token_counts else [])
        outputs = _LLM_OUTPUTS + ([_COUNT_OUTPUT] if token_counts else [])
        _python_model(root, name, inputs, outputs, decoupled=True, instances=instances,
                      params={"role": "llm", **timing})
        return root
    names = {role: f"{name}_{role}" for role, _, _ in _ENSEMBLE_STEPS}
    for role, (inputs, outputs) in _STEP_TENSORS.items():
        params = {"role": role, **(timing if role == "generate" else {})}
        _python_model(root, names[role], inputs, outputs, decoupled=role == "generate", instances=instances,
                      params=params)
    config = base_config(name, MOCK_MAX_BATCH_SIZE, _LLM_INPUTS, _LLM_OUTPUTS, platform="ensemble")
    for role, input_map, output_map in _ENSEMBLE_STEPS:
        step = config.ensemble_scheduling.step.add()
        step.model_name = names[role]
        step.model_version = -1
        step.input_map.update(input_map)
        step.output_map.update(output_map)
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(render(config), encoding="utf-8")
    return root
