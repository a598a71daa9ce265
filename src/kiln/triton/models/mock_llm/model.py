"""Triton Python model: kiln bench's mock LLM, a deterministic stand-in for a language model.

It has the ensemble's tensor contract, so the bench (and the serving stack around it) can be tested and measured
without a model. It is never a model: every token comes from :mod:`mock_tokens` (a hash of the prompt).
``kiln.serve.bench.write_mock_repository`` copies this file into a repository as ``<model>/1/model.py``, with
``mock_tokens.py`` and ``kiln_triton_utils.py`` beside it (it must not import kiln).

Roles (parameter ``role``): ``llm`` (default; ``text_input``, ``max_tokens``, optional ``stream`` and
``return_num_output_tokens`` in; ``text_output`` and ``num_output_tokens`` out; decoupled, streamed), or the
three steps of a mock ensemble: ``pre`` (text -> byte ids ``input_ids``/``input_lengths``), ``generate``
(``input_ids``, ``request_output_len``, optional ``streaming`` -> streamed ``output_ids``) and ``post``
(``output_ids`` -> ``text_output``).

Other parameters: ``token_delay_ms`` (sleep before each token; requests then run in their own threads),
``compute_ms`` (time each request takes before its first token, held exactly), ``final_with_last`` (mark the
last token's response final, as the ``tensorrt_llm`` backend does, instead of a flags-only final response as
decoupled BLS models do). A prompt starting with ``kiln-mock-fail`` gets an error response.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from kiln_triton_utils import get_bool_param, get_param, input_array
from mock_tokens import FAIL_PREFIX, token_ids, tokens_text


def _value(request, name, default=None):
    array = input_array(request, name)
    return default if array is None else array.reshape(-1)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.role = get_param(config, "role", "llm")
        self.token_delay = float(get_param(config, "token_delay_ms", "0")) / 1e3
        self.compute = float(get_param(config, "compute_ms", "0")) / 1e3
        self.final_with_last = get_bool_param(config, "final_with_last", False)
        self.batched = config.get("max_batch_size", 0) > 0

    def _shape(self, arr):
        return arr.reshape((1,) + arr.shape) if self.batched else arr

    def execute(self, requests):
        if self.role in ("pre", "post"):
            return [self._convert(r) for r in requests]
        for request in requests:
            if self.token_delay > 0:
                threading.Thread(target=self._generate, args=(request,), daemon=True).start()
            else:
                self._generate(request)
        return None

    def _convert(self, request):
        if self.role == "pre":
            text = _value(request, "text_input")[0]
            ids = np.frombuffer(bytes(text), dtype=np.uint8).astype(np.int32)
            out = [pb_utils.Tensor("input_ids", self._shape(ids)),
                   pb_utils.Tensor("input_lengths", self._shape(np.array([ids.size], dtype=np.int32)))]
        else:
            text = tokens_text(_value(request, "output_ids")).encode()
            out = [pb_utils.Tensor("text_output", self._shape(np.array([text], dtype=object)))]
        return pb_utils.InferenceResponse(output_tensors=out)

    def _busy(self, seconds):
        # Sleep most of it (a spinning thread holding the GIL would stall the stub's own thread, and a spinning
        # process loses the CPU on a busy machine), then spin the last millisecond for an exact end.
        end = time.perf_counter() + seconds
        if seconds > 0.001:
            time.sleep(seconds - 0.001)
        while time.perf_counter() < end:
            pass

    def _generate(self, request):
        sender = request.get_response_sender()
        try:
            if self.role == "generate":
                prompt = bytes(_value(request, "input_ids").astype(np.uint8))
                n = int(_value(request, "request_output_len")[0])
                stream = bool(_value(request, "streaming", [False])[0])
            else:
                prompt = bytes(_value(request, "text_input")[0])
                n = int(_value(request, "max_tokens")[0])
                stream = bool(_value(request, "stream", [False])[0])
            want_count = bool(_value(request, "return_num_output_tokens", [False])[0])
            if prompt.startswith(FAIL_PREFIX):
                raise ValueError("this prompt asks the mock to fail")
            if self.compute > 0:
                self._busy(self.compute)
            ids = token_ids(prompt, max(n, 0))
            groups = [[t] for t in ids] if stream else [ids]
            for i, group in enumerate(groups):
                if self.token_delay > 0:
                    time.sleep(self.token_delay * (len(group) if not stream else 1))
                if self.role == "generate":
                    out = [pb_utils.Tensor("output_ids", self._shape(np.array(group, dtype=np.int32)))]
                else:
                    text = tokens_text(group).encode()
                    out = [pb_utils.Tensor("text_output", self._shape(np.array([text], dtype=object)))]
                    if want_count:
                        count = np.array([len(group)], dtype=np.int32)
                        out.append(pb_utils.Tensor("num_output_tokens", self._shape(count)))
                last = self.final_with_last and i == len(groups) - 1
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=out), flags=flags)
            if not (self.final_with_last and groups):
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"mock model failed: {exc}")),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
