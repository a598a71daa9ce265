"""The engine runtime: where TensorRT-LLM's own work runs (its quantization, ``trtllm-build``, and the
evaluation of what it quantized). kiln orchestrates and never imports ``tensorrt_llm``: the work runs in the
NGC container that will serve the engine (docker, podman or Apptainer), or in a named local interpreter, through
the standalone worker scripts in ``kiln/runtime/workers/`` (they import only what the runtime has, never kiln).
"""

from kiln.runtime.engine_runtime import (
    EngineRuntime,
    Job,
    Mount,
    RuntimeFailed,
    RuntimeVersions,
    check_versions,
    engine_runtime_for,
    expected_versions,
    runtime_image,
)

__all__ = [
    "EngineRuntime",
    "Job",
    "Mount",
    "RuntimeFailed",
    "RuntimeVersions",
    "check_versions",
    "engine_runtime_for",
    "expected_versions",
    "runtime_image",
]
