"""The engine runtime: where TensorRT-LLM's own work runs (its quantization, ``trtllm-build``, and the
evaluation of what it quantized). kiln orchestrates and never imports ``tensorrt_llm``: the work runs in the
NGC container that will serve the engine (docker, podman or Apptainer), or in a named local interpreter, through
the standalone worker scripts in ``kiln/runtime/workers/``. They import only what the runtime has, never kiln, and
talk to kiln through a job file (JSON) in and a result file (JSON) out. That directory is shipped as data, not a
package of kiln (like the Triton models' directories), so the import-linter contract that kiln never imports
``tensorrt_llm`` holds with no exception for the quantize worker. kiln imports two of the scripts, for the code it
shares with the runtime (evaluate's math, check_engine's version check); tests/test_runtime_workers.py checks that
those import no TensorRT-LLM.
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
