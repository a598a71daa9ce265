"""What a serving pod needs from its host (no GPU needed): host memory, ``/dev/shm``, CPU, and how long loading
takes — the figures the deploy files size their containers and probes with (:func:`pod_sizing`).

Formulas (each constant below is a stated assumption; change it here, the README quotes this module):

* **host memory** of the serving container = ``SERVER_BASE_BYTES`` (tritonserver, the TensorRT-LLM runtime
  libraries, the CUDA context's host side) + **weights staging**: every rank on the pod reads its weights (engine
  or checkpoint shard) into host memory before copying them to its GPU, all ranks at once, so ``heaviest rank's
  weight bytes × ranks on the pod`` + ``PYTHON_MODEL_BYTES`` per Python-backend model (pre/post-processing, BLS:
  an interpreter with numpy and tokenizers each) + the **tokenizer**, ``vocab_size × TOKENIZER_BYTES_PER_TOKEN``
  in every model that loads it + ``/dev/shm`` (a memory-backed emptyDir counts against the container's memory).
* **/dev/shm** = ``SHM_BASE_BYTES`` (the Python backend's shared-memory pools that carry every request's tensors
  between Triton and the stubs) + ``NCCL_SHM_PER_GPU_BYTES`` per GPU when the pod has more than one (NCCL's
  intra-node buffers), rounded up to whole GiB.
* **load time** = the pod's weight bytes ÷ ``LOAD_RATE_BYTES_S`` (reading from the pod's volume); the init step's
  **pull time** = the repository's bytes (every rank's) ÷ ``PULL_RATE_BYTES_S`` (registry over the network).
* **startup probe**: ``STARTUP_BASE_S + STARTUP_SAFETY × load time`` before the pod is restarted.
* **CPU**: ``CPU_BASE`` cores + ``CPU_PER_GPU`` per GPU requested (the server, one executor thread per rank, the
  stubs); the limit is twice the request (loading and tokenizing burst).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
SERVER_BASE_BYTES = 2 * GIB
PYTHON_MODEL_BYTES = 512 * MIB
TOKENIZER_BYTES_PER_TOKEN = 2048
SHM_BASE_BYTES = 1 * GIB
NCCL_SHM_PER_GPU_BYTES = 512 * MIB
LOAD_RATE_BYTES_S = 500e6
"""Reading weights from the pod's volume: a local NVMe emptyDir or a network PVC, conservatively 500 MB/s."""
PULL_RATE_BYTES_S = 100e6
"""Pulling from the registry into the pod's volume: about 1 Gbit/s."""
STARTUP_BASE_S = 300
"""Server start, model configs, CUDA context, KV-cache allocation and warm-up, before weights are counted."""
STARTUP_SAFETY = 3
CPU_BASE = 2
CPU_PER_GPU = 2


@dataclass(frozen=True)
class PodSizing:
    """One serving pod's figures (bytes, seconds, cores) and how they were made."""

    weights_bytes: int
    """The pod's weights: the heaviest rank's × ranks on the pod."""
    repo_bytes: int
    """The whole repository the init step pulls (every rank's weights)."""
    host_memory_bytes: int
    shm_bytes: int
    load_seconds: float
    pull_seconds: float
    startup_seconds: int
    cpu: int
    basis: str

    @property
    def memory_mib(self) -> int:
        return math.ceil(self.host_memory_bytes / MIB)

    @property
    def shm_gib(self) -> int:
        return self.shm_bytes // GIB

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__}


def pod_sizing(*, rank_weight_bytes: int, total_weight_bytes: int, ranks_on_pod: int, gpus_on_pod: int,
               vocab_size: int, python_models: int, tokenizer_loads: int, basis: str) -> PodSizing:
    """The figures for a pod running ``ranks_on_pod`` ranks of ``rank_weight_bytes`` each (see the module)."""
    weights = rank_weight_bytes * ranks_on_pod
    shm = SHM_BASE_BYTES + (NCCL_SHM_PER_GPU_BYTES * gpus_on_pod if gpus_on_pod > 1 else 0)
    shm = math.ceil(shm / GIB) * GIB
    memory = (SERVER_BASE_BYTES + weights + PYTHON_MODEL_BYTES * python_models
              + vocab_size * TOKENIZER_BYTES_PER_TOKEN * tokenizer_loads + shm)
    load = weights / LOAD_RATE_BYTES_S
    return PodSizing(weights_bytes=weights, repo_bytes=total_weight_bytes, host_memory_bytes=memory, shm_bytes=shm,
                     load_seconds=round(load, 1), pull_seconds=round(total_weight_bytes / PULL_RATE_BYTES_S, 1),
                     startup_seconds=math.ceil(STARTUP_BASE_S + STARTUP_SAFETY * load),
                     cpu=CPU_BASE + CPU_PER_GPU * gpus_on_pod, basis=basis)
