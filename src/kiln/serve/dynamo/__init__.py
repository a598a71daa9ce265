"""NVIDIA Dynamo in front of kiln's CPU reference runtime: a TEST AND DEVELOPMENT VEHICLE, not a serving path.

On a GPU, Dynamo's ``python -m dynamo.trtllm`` worker registers TensorRT-LLM with Dynamo's runtime and the Dynamo
frontend (``python -m dynamo.frontend``) serves the OpenAI API in front of it (kiln writes those launch files and
Kubernetes manifests: :mod:`kiln.triton.deploy.dynamo`). On a CPU, :mod:`kiln.serve.dynamo.worker` plays the role of
``dynamo.trtllm``: it registers with the real Dynamo runtime through its Python API (``dynamo.llm.register_model``,
``Endpoint.serve_endpoint``) and answers with kiln's CPU reference runtime loading the unified checkpoint the
pytorch target wrote, so the real frontend, router and discovery run end to end on a machine without a GPU.

Everything runs with file discovery, the TCP request plane and every address on 127.0.0.1: no etcd, no NATS
(:func:`dynamo_env`). Dynamo is installed by the Makefile (``make install``: ``ai-dynamo``/``ai-dynamo-runtime``
with ``--no-deps``; see the comment there); kiln imports it only here and in the worker.
"""

from kiln.serve.dynamo.launch import (
    DYNAMO_VERSION,
    DynamoStack,
    dynamo_available,
    dynamo_env,
    frontend_command,
    serve_foreground,
    stack_for_repository,
    worker_command,
)

__all__ = ["DYNAMO_VERSION", "DynamoStack", "dynamo_available", "dynamo_env", "frontend_command", "serve_foreground",
           "stack_for_repository", "worker_command"]
