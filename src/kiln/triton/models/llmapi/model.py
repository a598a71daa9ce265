"""Triton Python model ``tensorrt_llm`` for kiln's ``pytorch`` target: Triton's llmapi contract, served by
TensorRT-LLM's LLM API (PyTorch backend) on the GPU, or by kiln's CPU reference runtime.

kiln copies this file into generated repositories as ``tensorrt_llm/1/model.py`` with ``kiln_triton_utils.py`` and
``kiln_llmapi_reference.py`` beside it; it imports nothing else of kiln. It is kiln's own model, written against
TensorRT-LLM 1.2.1's LLM API (the calls are checked against kiln/runtime/data/upstream_api.yaml by
tests/test_llmapi_model.py) and upstream's llmapi tensor contract (kiln/triton/data/llmapi_model.yaml):

* inputs ``text_input`` (one prompt, 1-D), ``streaming``, ``sampling_param_*`` (each → the SamplingParams keyword
  of the same name), ``return_finish_reason`` / ``return_stop_reason`` / ``return_cumulative_logprob``, and
  ``stop`` (cancel the running requests that carry this request's id);
* outputs ``text_output`` (the LLM API's ``CompletionOutput.text``: cumulative while streaming, the prompt in front
  unless ``exclude_input_from_output``), the asked-for ``finish_reason`` / ``stop_reason`` / ``cumulative_logprob``,
  and the per-request performance metrics when ``sampling_param_return_perf_metrics`` is true (GPU runtime only),
  each with its declared type.

Prompt scoring (kiln's extension of the contract, the same as the reference ``tensorrt_llm`` model's, for the OpenAI
server's ``echo``/loglikelihood requests): the optional input ``return_prompt_log_probs``; when true the request
asks the LLM for one greedy token with ``SamplingParams(prompt_logprobs=1)`` (the LLM computes them from its context
logits on the GPU: only these numbers leave it) and answers with ``prompt_log_probs`` FP32[n] (entry j: log-prob of
prompt token j given the tokens before it; entry 0 is 0), ``prompt_top_ids`` INT32[n+1] and
``prompt_top_log_probs`` FP32[n+1] (entry j: the argmax token predicting position j and its log-prob; entry 0 is
-1 / 0; entry n is the greedy next token, the one generated).

``model.yaml`` (or the file ``$LLM_CONFIG_PATH`` names) holds the LLM arguments and ``triton_config``; every key
but ``triton_config`` goes to ``LLM`` through TensorRT-LLM's own ``update_llm_args_with_extra_dict`` (which builds
the speculative-decoding config from its ``decoding_type``). Relative paths in ``model`` and
``speculative_config.speculative_model_dir`` are resolved against this version directory. ``triton_config`` sets
``decoupled`` and ``max_batch_size`` (via auto_complete_config when the server completes configs); a config.pbtxt
that disagrees with it is refused at load, so the served config is what model.yaml says.

Parameters (config.pbtxt): ``runtime`` — ``tensorrt_llm`` (default; the GPU) or ``reference`` (kiln's CPU runtime,
a test and development vehicle, not a fast path); ``exclude_input_from_output`` — the default when a request
does not send ``sampling_param_exclude_input_from_output`` (upstream's model: false); ``num_threads`` — torch
threads of the reference runtime.
"""

from kiln_triton_utils import use_utf8_locale

use_utf8_locale()  # the libraries below read files that need UTF-8

import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
import yaml  # noqa: E402
from kiln_triton_utils import RequestError, get_bool_param, get_int_param, get_param, input_array  # noqa: E402

CONFIG_ENV = "LLM_CONFIG_PATH"
CONFIG_FILE = "model.yaml"
#: Input → SamplingParams keyword (upstream helpers.get_sampling_params_from_request), and how a value is read.
SAMPLING_INPUTS = {
    "sampling_param_best_of": ("best_of", int),
    "sampling_param_temperature": ("temperature", float),
    "sampling_param_top_k": ("top_k", int),
    "sampling_param_top_p": ("top_p", float),
    "sampling_param_frequency_penalty": ("frequency_penalty", float),
    "sampling_param_presence_penalty": ("presence_penalty", float),
    "sampling_param_max_tokens": ("max_tokens", int),
    "sampling_param_seed": ("seed", int),
    "sampling_param_exclude_input_from_output": ("exclude_input_from_output", bool),
    "sampling_param_return_perf_metrics": ("return_perf_metrics", bool),
}
STOP_INPUT = ("sampling_param_stop", "stop")
#: Output switch → the CompletionOutput attribute it sends.
OUTPUT_SWITCHES = {"return_finish_reason": "finish_reason", "return_stop_reason": "stop_reason",
                   "return_cumulative_logprob": "cumulative_logprob"}
#: kiln's prompt-scoring extension (module docstring): the switch and the outputs it fills.
SCORE_INPUT = "return_prompt_log_probs"
SCORE_OUTPUTS = ("prompt_log_probs", "prompt_top_ids", "prompt_top_log_probs")
PATH_KEYS = (("model",), ("speculative_config", "speculative_model_dir"))


# ---------------------------------------------------------------------------------------------- model.yaml
def read_model_yaml(version_dir):
    """(LLM arguments, triton_config) from model.yaml; errors name the file and what is wrong."""
    path = os.path.join(version_dir, os.environ.get(CONFIG_ENV, CONFIG_FILE))
    if not os.path.isfile(path):
        raise ValueError(f"tensorrt_llm (llmapi): {path} not found: it holds the LLM arguments and triton_config")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        raise ValueError(f"tensorrt_llm (llmapi): {path} is not valid YAML: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("triton_config"), dict):
        raise ValueError(f"tensorrt_llm (llmapi): {path} needs a triton_config mapping (decoupled, max_batch_size)")
    triton_config = data.pop("triton_config")
    for key in ("decoupled", "max_batch_size"):
        if key not in triton_config:
            raise ValueError(f"tensorrt_llm (llmapi): {path}: triton_config.{key} is missing")
    for keys in PATH_KEYS:
        node = data
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        value = node.get(keys[-1]) if isinstance(node, dict) else None
        # a path relative to this version directory (the checkpoint, a packaged draft or EAGLE3 head); anything
        # else (a Hugging Face Hub id such as org/name) is left for TensorRT-LLM to resolve
        if isinstance(value, str) and value and not os.path.isabs(value) \
                and os.path.exists(os.path.join(version_dir, value)):
            node[keys[-1]] = os.path.join(version_dir, value)
    return data, triton_config


def config_mismatches(model_config, triton_config):
    """Where config.pbtxt disagrees with triton_config (with --disable-auto-complete-config the server runs what
    config.pbtxt says, so a disagreement means the served model is not what model.yaml says)."""
    problems = []
    served = bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))
    if served != bool(triton_config["decoupled"]):
        problems.append(f"config.pbtxt decoupled is {served}, model.yaml triton_config.decoupled is "
                        f"{bool(triton_config['decoupled'])}")
    if int(model_config.get("max_batch_size", 0)) != int(triton_config["max_batch_size"]):
        problems.append(f"config.pbtxt max_batch_size is {model_config.get('max_batch_size', 0)}, model.yaml "
                        f"triton_config.max_batch_size is {triton_config['max_batch_size']}")
    return problems


def _scalar(request, name, cast):
    array = input_array(request, name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    if cast is bool:
        return bool(value)
    return cast(value.item() if hasattr(value, "item") else value)


def _text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _ns(value):
    """A perf-metrics time (a timedelta, or seconds) in integer nanoseconds."""
    if isinstance(value, datetime.timedelta):
        return int(value / datetime.timedelta(microseconds=1)) * 1000
    return int(float(value) * 1e9)


# ---------------------------------------------------------------------------------------------- the model
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """As upstream's llmapi model: max_batch_size and decoupled come from model.yaml's triton_config."""
        version_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)))
        _, triton_config = read_model_yaml(version_dir)
        auto_complete_model_config.set_model_transaction_policy({"decoupled": bool(triton_config["decoupled"])})
        auto_complete_model_config.set_max_batch_size(int(triton_config["max_batch_size"]))
        return auto_complete_model_config

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        llm_args, triton_config = read_model_yaml(version_dir)
        problems = config_mismatches(self.model_config, triton_config)
        if problems:
            raise ValueError("tensorrt_llm (llmapi): " + "; ".join(problems) + ": make them agree (kiln package "
                             "writes both from the recipe)")
        self.decoupled = bool(triton_config["decoupled"])
        self.check_period = int(triton_config.get("cancellation_check_period_ms", 100)) / 1000.0
        self.runtime = get_param(self.model_config, "runtime", "tensorrt_llm")
        self.exclude_input = get_bool_param(self.model_config, "exclude_input_from_output", False)
        self.outputs = {out["name"]: out for out in self.model_config.get("output", [])}
        self.jobs = {}  # id -> job (dict): triton request, its response sender, the request output's abort
        # Guards self.jobs and every response send: a final response releases the request's response factory, and
        # is_cancelled() on a released one crashes the server, so the cancellation poll and the sends exclude each
        # other and the poll only asks jobs that have not sent their final response.
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        t0 = time.monotonic()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="kiln-llmapi-loop", daemon=True)
        self.loop_thread.start()
        asyncio.run_coroutine_threadsafe(self._start(llm_args), self.loop).result()
        self.cancel_thread = threading.Thread(target=self._cancellation_loop, name="kiln-llmapi-cancel", daemon=True)
        self.cancel_thread.start()
        label = ("TensorRT-LLM LLM API (PyTorch backend)" if self.runtime == "tensorrt_llm" else
                 "kiln's CPU reference runtime (a test and development vehicle, not a fast path)")
        pb_utils.Logger.log_info(f"tensorrt_llm (llmapi): {label}, model {llm_args.get('model')}, ready in "
                                 f"{time.monotonic() - t0:.1f}s, decoupled={self.decoupled}")

    async def _start(self, llm_args):
        """Create the engine on the event loop's thread (the LLM API runs its request outputs on that loop)."""
        if self.runtime == "tensorrt_llm":
            from tensorrt_llm import LLM, SamplingParams
            from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

            engine_args = update_llm_args_with_extra_dict({}, llm_args)
            self.sampling_params = SamplingParams
            self._llm = LLM(**engine_args)
        elif self.runtime == "reference":
            # Before torch loads its OpenMP runtime: idle OpenMP workers sleep instead of spinning (this model runs
            # its own threads beside the stub's, often on few, shared cores).
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            from kiln_llmapi_reference import ReferenceLLM
            from kiln_llmapi_reference import SamplingParams as ReferenceSamplingParams

            self.sampling_params = ReferenceSamplingParams
            threads = get_int_param(self.model_config, "num_threads", None, minimum=1)
            reference = ReferenceLLM(**llm_args, num_threads=threads)
            if reference.not_applied:
                pb_utils.Logger.log_info("tensorrt_llm (llmapi reference): GPU-only LLM arguments not applied on "
                                         "the CPU: " + ", ".join(reference.not_applied))
            self._llm = reference
        else:
            raise ValueError(f"tensorrt_llm (llmapi): parameter runtime is {self.runtime!r}; use tensorrt_llm "
                             "(the GPU) or reference (kiln's CPU test and development vehicle)")

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)
        return None

    def _parse(self, request):
        text = input_array(request, "text_input")
        if text is None:
            raise RequestError("text_input is missing from the request")
        text = np.asarray(text)
        if text.ndim != 1 or text.size < 1:
            raise RequestError(f"text_input must be a 1-D tensor holding one prompt, got shape {list(text.shape)}")
        kwargs = {"exclude_input_from_output": self.exclude_input}
        for name, (keyword, cast) in SAMPLING_INPUTS.items():
            value = _scalar(request, name, cast)
            if value is not None:
                kwargs[keyword] = value
        stop = input_array(request, STOP_INPUT[0])
        if stop is not None:
            kwargs[STOP_INPUT[1]] = [_text(s) for s in np.asarray(stop).reshape(-1)]
        switches = {name: bool(_scalar(request, name, bool)) for name in OUTPUT_SWITCHES}
        streaming = bool(_scalar(request, "streaming", bool))
        switches[SCORE_INPUT] = bool(_scalar(request, SCORE_INPUT, bool))
        if switches[SCORE_INPUT]:  # one greedy token, the prompt's log-probs with the top-1 alternative
            missing = [name for name in SCORE_OUTPUTS if name not in self.outputs]
            if missing:
                raise RequestError(f"{SCORE_INPUT}: this model's config.pbtxt does not declare {missing}")
            kwargs.update(max_tokens=1, top_k=1, prompt_logprobs=1, exclude_input_from_output=True)
            kwargs.pop("stop", None)
            streaming = False
        if streaming and not self.decoupled:
            raise RequestError("streaming needs a decoupled model: set serving.streaming (triton_config.decoupled) "
                               "or send streaming=false")
        return _text(text.reshape(-1)[0]), kwargs, switches, streaming

    async def _serve(self, request):
        sender = request.get_response_sender()
        key = id(request)
        try:
            if _scalar(request, "stop", bool):
                self._stop_by_id(request, sender)
                return
            prompt, kwargs, switches, streaming = self._parse(request)
            try:
                params = self.sampling_params(**kwargs)
            except (TypeError, ValueError) as err:
                raise RequestError(f"invalid sampling parameters: {err}") from None
            result = self._llm.generate_async(prompt, sampling_params=params, streaming=streaming)
            with self.lock:
                self.jobs[key] = {"request": request, "sender": sender, "abort": result.abort, "done": False}
            final = None
            async for output in result:
                final = output
                if streaming and not output.finished:
                    response = self._response(output, switches)
                    with self.lock:
                        if not self._cancelled(key):
                            sender.send(response, flags=0)
            if final is not None:
                self._finish(key, sender, self._response(final, switches))
        except RequestError as err:
            self._finish(key, sender, self._error(str(err)))
        except ValueError as err:  # the engine refused the request (a limit, a sampling value): say why, keep serving
            pb_utils.Logger.log_warn(f"tensorrt_llm (llmapi): request refused: {err}")
            self._finish(key, sender, self._error(f"error generating the request: {type(err).__name__}: {err}"))
        except Exception as err:  # the engine failed this request: say so, keep serving
            pb_utils.Logger.log_error(f"tensorrt_llm (llmapi): {traceback.format_exc()}")
            self._finish(key, sender, self._error(f"error generating the request: {type(err).__name__}: {err}"))
        finally:
            with self.lock:
                self.jobs.pop(key, None)

    def _cancelled(self, key):
        with self.lock:
            job = self.jobs.get(key)
            return job is not None and job["done"]

    def _finish(self, key, sender, response):
        """Send the final response once (a cancellation may have sent it already)."""
        with self.lock:
            job = self.jobs.get(key)
            if job is not None:
                if job["done"]:
                    return
                job["done"] = True
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _error(self, message, code=None):
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=error)

    def _scores(self, output: "tensorrt_llm.llmapi.RequestOutput"):
        """The prompt-scoring outputs (module docstring) from ``CompletionOutput.prompt_logprobs``: per prompt
        position 1..n-1, {token id: Logprob} holding the top-1 token and the prompt's own token."""
        first = output.outputs[0]
        rows = first.prompt_logprobs or []
        ids = list(output.prompt_token_ids)
        if len(rows) != len(ids) - 1:
            raise RequestError(f"{SCORE_INPUT}: the LLM returned {len(rows)} prompt log-prob rows for a "
                               f"{len(ids)}-token prompt (expected {len(ids) - 1})")
        chosen, top_ids, top_lps = [0.0], [-1], [0.0]
        for token, row in zip(ids[1:], rows):
            chosen.append(row[token].logprob)
            best = min(row.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                    -kv[1].logprob))
            top_ids.append(int(best[0]))
            top_lps.append(best[1].logprob)
        top_ids.append(int(first.token_ids[-1]) if first.token_ids else -1)  # the greedy next token
        top_lps.append(first.cumulative_logprob if first.cumulative_logprob is not None else np.nan)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("prompt_log_probs", np.array(chosen, dtype=np.float32)),
            pb_utils.Tensor("prompt_top_ids", np.array(top_ids, dtype=np.int32)),
            pb_utils.Tensor("prompt_top_log_probs", np.array(top_lps, dtype=np.float32))])

    def _response(self, output: "tensorrt_llm.llmapi.RequestOutput", switches):
        if switches.get(SCORE_INPUT):
            return self._scores(output)
        tensors = [pb_utils.Tensor("text_output", np.array([o.text.encode("utf-8") for o in output.outputs],
                                                           dtype=np.object_))]
        for switch, attr in OUTPUT_SWITCHES.items():
            if switches[switch] and attr in self.outputs:
                values = [getattr(o, attr) for o in output.outputs]
                if attr == "cumulative_logprob":
                    array = np.array([np.nan if v is None else v for v in values], dtype=np.float32)
                else:
                    array = np.array([("" if v is None else str(v)).encode("utf-8") for v in values], dtype=np.object_)
                tensors.append(pb_utils.Tensor(attr, array))
        tensors += self._perf_metrics(output)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _perf_metrics(self, output: "tensorrt_llm.llmapi.RequestOutput"):
        """Per-request metrics of the LLM API (asked for with sampling_param_return_perf_metrics), typed as the
        contract declares them."""
        if not output.outputs:
            return []
        first = output.outputs[0]
        metrics = first.request_perf_metrics
        if not metrics:
            return []
        kv, timing, spec = metrics.kv_cache_metrics, metrics.timing_metrics, metrics.speculative_decoding
        values = {
            "kv_cache_reused_block": (kv.num_reused_blocks, np.int32),
            "kv_cache_missed_block": (kv.num_missed_blocks, np.int32),
            "kv_cache_alloc_new_blocks": (kv.num_new_allocated_blocks, np.int32),
            "kv_cache_alloc_total_blocks": (kv.num_total_allocated_blocks, np.int32),
            "kv_cache_hit_rate": (kv.kv_cache_hit_rate, np.float32),
            "arrival_time_ns": (_ns(timing.arrival_time), np.int64),
            "first_scheduled_time_ns": (_ns(timing.first_scheduled_time), np.int64),
            "first_token_time_ns": (_ns(timing.first_token_time), np.int64),
            "last_token_time_ns": (_ns(timing.last_token_time), np.int64),
            "acceptance_rate": (spec.acceptance_rate, np.float32),
            "total_accepted_draft_tokens": (spec.total_accepted_draft_tokens, np.int32),
            "total_draft_tokens": (spec.total_draft_tokens, np.int32),
        }
        return [pb_utils.Tensor(name, np.array([value], dtype=dtype)) for name, (value, dtype) in values.items()
                if name in self.outputs]

    def _stop_by_id(self, request, sender):
        """Upstream's ``stop`` input: cancel every running request with this request's id."""
        triton_id = request.request_id()
        if not triton_id:
            sender.send(self._error("a stop request needs the request id of the request to stop"),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        with self.lock:
            matches = [k for k, j in self.jobs.items() if not j["done"] and j["request"].request_id() == triton_id]
        for key in matches:
            self._cancel(key)
        sender.send(self._error("Request cancelled by client", pb_utils.TritonError.CANCELLED),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _cancel(self, key):
        with self.lock:
            job = self.jobs.get(key)
            if job is None or job["done"]:
                return
            job["abort"]()
            pb_utils.Logger.log_info(f"tensorrt_llm (llmapi): request {job['request'].request_id()!r} cancelled: "
                                     "generation aborted")
            self._finish(key, job["sender"], self._error("Request cancelled by client",
                                                         pb_utils.TritonError.CANCELLED))

    def _cancellation_loop(self):
        while not self.stopping.wait(self.check_period):
            with self.lock:  # no final response can be sent while the poll asks (see self.lock)
                for key, job in list(self.jobs.items()):
                    if job["done"]:
                        continue
                    try:
                        cancelled = job["request"].is_cancelled()
                    except Exception:
                        cancelled = False
                    if cancelled:
                        self._cancel(key)

    def finalize(self):
        self.stopping.set()
        with self.lock:
            keys = list(self.jobs)
        for key in keys:
            self._cancel(key)
        try:
            self._llm.shutdown()
        except Exception:
            pb_utils.Logger.log_error(f"tensorrt_llm (llmapi): shutdown: {traceback.format_exc()}")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
