"""The GPU table: datasheet figures kiln plans and validates against.

Figures are per GPU and come from NVIDIA's datasheets (named in each entry's ``source``).

- ``tflops`` holds **dense** tensor-core throughput (datasheets print the 2:4-sparsity figure, twice the
  dense one, with an asterisk; we halve it). Keys: ``fp16``, ``bf16``, ``fp8``, ``int8`` (TOPS), ``fp4``;
  a key is absent when the GPU's tensor cores do not support the type.
- ``memory_gib`` is the capacity the driver reports (``nvidia-smi --query-gpu=memory.total``, MiB / 1024),
  which is what CUDA can use; the datasheet's marketing capacity is named in ``source``.
- ``bandwidth_gbs`` is the datasheet's peak memory bandwidth in GB/s (10^9 bytes per second).
- ``sm`` is the CUDA compute capability as an int (8.0 -> 80, 9.0 -> 90, 10.0 -> 100).
- ``interconnect`` is how the GPUs of one server talk to each other (:class:`Interconnect`): the link, its
  bandwidth per GPU and direction in GB/s, and the latency of one small all-reduce. The planner's tensor- and
  pipeline-parallel communication uses these published figures; nothing here is fitted.

Only the standard library is imported here: the recipe layer sits low in kiln's layering.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = [
    "Interconnect",
    "GPUSpec",
    "GPUS",
    "lookup_gpu",
    "known_gpu_names",
    "gpus_with_sm",
    "detect_gpus",
    "detected_gpu_names",
]


@dataclass(frozen=True)
class Interconnect:
    """GPU-to-GPU link inside one server, as published.

    ``gbs`` is the bandwidth one GPU can send in one direction (GB/s, 10^9 bytes/s): NVLink's per-GPU figure
    halved (datasheets print both directions together), or one PCIe x16 link's per-direction figure.
    ``latency_us`` is the time of one small (8 KB) all-reduce between two GPUs as NVIDIA measured it with
    TensorRT-LLM's own all-reduce kernel; it stands for the fixed cost of every collective.
    """

    kind: str
    gbs: float
    latency_us: float
    source: str


# Interconnect figures. Bandwidth: NVIDIA's aiconfigurator system files (ai-dynamo/aiconfigurator
# @095f58a51c4ca8e61b66ec108d86f223f8d559ce, aic-core/src/aiconfigurator_core/systems/<gpu>.yaml,
# `intra_node_bw`, per GPU and direction), which agree with NVIDIA's NVLink generations (NVLink 3: 12 links,
# 600 GB/s both directions; NVLink 4: 18 links, 900 GB/s; NVLink 5: 18 links, 1.8 TB/s) and PCIe x16 (Gen4
# 32 GB/s, Gen5 64 GB/s per direction). Latency: TensorRT-LLM's custom all-reduce, bf16, 8 KB, 2 GPUs, as
# timed by NVIDIA on each GPU (same repository, systems/data/<gpu>/comm/trtllm/<version>/
# custom_allreduce_perf.parquet): A100 SXM 4.7 us (TensorRT-LLM 1.0.0), H100 SXM 2.8 us, H200 SXM 2.8 us,
# B200 4.8 us, L40S (PCIe 4.0) 7.7 us (1.3.0rc20). GPUs NVIDIA did not time take the measured GPU with the
# same kind of link, as each entry says.
_AIC = "ai-dynamo/aiconfigurator@095f58a5 systems/{}.yaml intra_node_bw; all-reduce latency: {}"
_NVLINK3 = Interconnect("NVLink 3", 300.0, 4.7, _AIC.format("a100_sxm", "A100 SXM custom all-reduce 8 KB, 2 GPUs"))
_NVLINK4 = Interconnect("NVLink 4", 450.0, 2.8, _AIC.format("h100_sxm / h200_sxm",
                                                            "H100/H200 SXM custom all-reduce 8 KB, 2 GPUs"))
_NVLINK5 = Interconnect("NVLink 5", 900.0, 4.8, _AIC.format("b200_sxm / gb200",
                                                            "B200 custom all-reduce 8 KB, 2 GPUs"))
_PCIE4_LATENCY = "L40S (PCIe 4.0) custom all-reduce 8 KB, 2 GPUs"


def _pcie(gen: int, yaml_name: str, latency_note: str = _PCIE4_LATENCY) -> Interconnect:
    return Interconnect(f"PCIe {gen}.0 x16", {4: 32.0, 5: 64.0}[gen], 7.7, _AIC.format(yaml_name, latency_note))


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model's datasheet figures (see the module docstring for units and conventions)."""

    name: str
    aliases: tuple[str, ...]
    sm: int
    memory_gib: float
    bandwidth_gbs: float
    tflops: dict = field(hash=False)
    source: str
    interconnect: Interconnect | None = None

    def supports(self, dtype: str) -> bool:
        """Whether the tensor cores have a throughput figure for ``dtype`` (fp16, bf16, fp8, int8, fp4)."""
        return dtype in self.tflops


def _spec(
    name: str,
    aliases: tuple[str, ...],
    sm: int,
    memory_mib: int,
    bandwidth_gbs: float,
    tflops: dict[str, float],
    source: str,
    interconnect: Interconnect,
) -> GPUSpec:
    return GPUSpec(
        name=name,
        aliases=aliases,
        sm=sm,
        memory_gib=round(memory_mib / 1024, 2),
        bandwidth_gbs=bandwidth_gbs,
        tflops=dict(tflops),
        source=source,
        interconnect=interconnect,
    )


_TABLE: tuple[GPUSpec, ...] = (
    # Ampere. A100 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): FP16/BF16 tensor 312 TFLOPS (624 sparse),
    # INT8 624 TOPS (1248 sparse); no FP8. Bandwidth 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM),
    # 1,935 GB/s (80GB PCIe).
    _spec(
        "A100-40GB",
        ("A100-SXM4-40GB", "A100-SXM-40GB", "A100-PCIE-40GB", "A100 40GB"),
        80,
        40960,
        1555.0,
        {"fp16": 312.0, "bf16": 312.0, "int8": 624.0},
        "NVIDIA A100 Tensor Core GPU datasheet (40GB HBM2, SXM4/PCIe: same tensor peaks and bandwidth)",
        _NVLINK3,  # the SXM4 board; a 40GB PCIe card without an NVLink bridge talks over PCIe 4.0
    ),
    _spec(
        "A100-80GB",
        ("A100-SXM4-80GB", "A100-SXM-80GB", "A100-80GB-SXM", "A100 80GB SXM"),
        80,
        81920,
        2039.0,
        {"fp16": 312.0, "bf16": 312.0, "int8": 624.0},
        "NVIDIA A100 Tensor Core GPU datasheet (80GB HBM2e, SXM4)",
        _NVLINK3,
    ),
    _spec(
        "A100-80GB-PCIe",
        ("A100 80GB PCIe", "A100-PCIE-80GB", "A100-80GB-PCIE"),
        80,
        81920,
        1935.0,
        {"fp16": 312.0, "bf16": 312.0, "int8": 624.0},
        "NVIDIA A100 Tensor Core GPU datasheet (80GB HBM2e, PCIe)",
        _pcie(4, "a100_pcie"),  # "PCIe Gen4 x16 without NVLink"
    ),
    # Ada. L40S datasheet (nvidia.com/en-us/data-center/l40s/, "L40S Product Brief"): BF16/FP16 tensor
    # 362.05 TFLOPS (733 sparse), FP8 733 (1,466 sparse), INT8 733 TOPS (1,466 sparse); 48 GB GDDR6 with
    # ECC, 864 GB/s.
    _spec(
        "L40S",
        ("L40S-48GB",),
        89,
        46068,
        864.0,
        {"fp16": 362.05, "bf16": 362.05, "fp8": 733.0, "int8": 733.0},
        "NVIDIA L40S datasheet (48 GB GDDR6 ECC; driver reports 46,068 MiB)",
        _pcie(4, "l40s"),  # no NVLink
    ),
    # L4 datasheet (nvidia.com/en-us/data-center/l4/): FP16/BF16 tensor 242 TFLOPS sparse -> 121 dense,
    # FP8 485 sparse -> 242.5, INT8 485 TOPS sparse -> 242.5; 24 GB GDDR6, 300 GB/s.
    _spec(
        "L4",
        ("L4-24GB",),
        89,
        23034,
        300.0,
        {"fp16": 121.0, "bf16": 121.0, "fp8": 242.5, "int8": 242.5},
        "NVIDIA L4 Tensor Core GPU datasheet (24 GB GDDR6; driver reports 23,034 MiB)",
        _pcie(4, "l4"),  # no NVLink
    ),
    # GeForce RTX 4090: NVIDIA Ada GPU Architecture whitepaper (Appendix A, RTX 4090): FP16/BF16 tensor
    # with FP32 accumulate 165.2 TFLOPS (330.3 sparse), FP8 with FP32 accumulate 330.3 (660.6 sparse),
    # INT8 660.6 TOPS (1,321.2 sparse); 24 GB GDDR6X, 1,008 GB/s. FP32-accumulate figures are used
    # because that is what LLM GEMMs run with.
    _spec(
        "RTX-4090",
        ("GeForce RTX 4090", "RTX 4090", "RTX4090", "4090"),
        89,
        24564,
        1008.0,
        {"fp16": 165.2, "bf16": 165.2, "fp8": 330.3, "int8": 660.6},
        "NVIDIA Ada Lovelace architecture whitepaper v2.01, RTX 4090 (FP32 accumulate)",
        _pcie(4, "l40s (the same Ada PCIe 4.0 link; the RTX 4090 has no NVLink)"),
    ),
    # Hopper. H100 datasheet (nvidia.com/en-us/data-center/h100/, "H100 Tensor Core GPU datasheet"):
    # SXM: BF16/FP16 1,979 TFLOPS sparse -> 989 dense (989.4), FP8 3,958 sparse -> 1,979, INT8 3,958 TOPS
    # sparse -> 1,979; 80 GB HBM3, 3.35 TB/s. PCIe: BF16/FP16 1,513 sparse -> 756, FP8/INT8 3,026 sparse
    # -> 1,513; 80 GB HBM2e, 2 TB/s.
    _spec(
        "H100-SXM",
        ("H100", "H100-SXM5-80GB", "H100-SXM5", "H100 80GB HBM3", "H100-80GB-HBM3", "H100 SXM"),
        90,
        81559,
        3350.0,
        {"fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
        "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM (80 GB HBM3; driver reports 81,559 MiB)",
        _NVLINK4,
    ),
    _spec(
        "H100-PCIe",
        ("H100 PCIe", "H100-PCIE-80GB", "H100 80GB PCIe"),
        90,
        81559,
        2000.0,
        {"fp16": 756.0, "bf16": 756.0, "fp8": 1513.0, "int8": 1513.0},
        "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe (80 GB HBM2e)",
        _pcie(5, "h100_pcie", _PCIE4_LATENCY + " (no PCIe 5.0 timing published)"),  # "PCIe Gen5 x16 without NVLink"
    ),
    # H200 datasheet (nvidia.com/en-us/data-center/h200/): H200 SXM: same tensor peaks as H100 SXM
    # (BF16/FP16 1,979 sparse, FP8/INT8 3,958 sparse); 141 GB HBM3e, 4.8 TB/s.
    _spec(
        "H200",
        ("H200-SXM", "H200-141GB", "H200 SXM"),
        90,
        143771,
        4800.0,
        {"fp16": 989.0, "bf16": 989.0, "fp8": 1979.0, "int8": 1979.0},
        "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM (141 GB HBM3e; driver reports 143,771 MiB)",
        _NVLINK4,
    ),
    # Blackwell. HGX B200 datasheet (nvidia.com/en-us/data-center/hgx/, per GPU): FP4 tensor 18 PFLOPS
    # sparse -> 9 dense, FP8/FP6 9 sparse -> 4.5, INT8 9 POPS sparse -> 4.5, FP16/BF16 4.5 sparse -> 2.25;
    # 180 GB HBM3e, 8 TB/s.
    _spec(
        "B200",
        ("B200-SXM", "HGX B200", "B200-180GB"),
        100,
        183359,
        8000.0,
        {"fp16": 2250.0, "bf16": 2250.0, "fp8": 4500.0, "int8": 4500.0, "fp4": 9000.0},
        "NVIDIA HGX B200 datasheet, per GPU (180 GB HBM3e)",
        _NVLINK5,
    ),
    # GB200 NVL72 datasheet (nvidia.com/en-us/data-center/gb200-nvl72/), divided by its 72 GPUs:
    # FP4 1,440 PFLOPS sparse -> 10 PFLOPS dense per GPU, FP8/FP6 720 -> 5, INT8 720 POPS -> 5,
    # FP16/BF16 360 -> 2.5; HBM3e 13.4 TB -> 186 GB per GPU; 576 TB/s -> 8 TB/s per GPU.
    _spec(
        "GB200",
        ("GB200-NVL72", "GB200 NVL72"),
        100,
        189471,
        8000.0,
        {"fp16": 2500.0, "bf16": 2500.0, "fp8": 5000.0, "int8": 5000.0, "fp4": 10000.0},
        "NVIDIA GB200 NVL72 datasheet, divided per GPU (186 GB HBM3e)",
        _NVLINK5,  # one NVLink domain across the rack
    ),
)
# Not listed: A10G (AWS's A10 variant) — NVIDIA publishes no tensor-throughput datasheet for it.

GPUS: dict[str, GPUSpec] = {spec.name: spec for spec in _TABLE}


def _normalize(name: str) -> str:
    """Uppercase and drop vendor prefixes, spaces, hyphens and underscores: 'NVIDIA H100 PCIe' -> 'H100PCIE'."""
    text = name.strip().upper()
    for prefix in ("NVIDIA ", "GEFORCE "):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return re.sub(r"[\s\-_]+", "", text)


def _index() -> dict[str, str]:
    index: dict[str, str] = {}
    for spec in _TABLE:
        for candidate in (spec.name, *spec.aliases):
            key = _normalize(candidate)
            owner = index.setdefault(key, spec.name)
            if owner != spec.name:  # pragma: no cover - guards the table above
                raise AssertionError(f"GPU alias {candidate!r} maps to both {owner} and {spec.name}")
    return index


_INDEX = _index()


def lookup_gpu(name: str) -> GPUSpec | None:
    """The spec for a canonical name or alias (case-, space- and hyphen-insensitive), or None.

    Also accepts the names ``nvidia-smi`` prints, e.g. ``"NVIDIA H100 80GB HBM3"``.
    """
    key = _INDEX.get(_normalize(name))
    return GPUS[key] if key is not None else None


def known_gpu_names() -> list[str]:
    """Canonical names of every GPU in the table, in table order (oldest architecture first)."""
    return list(GPUS)


def gpus_with_sm(min_sm: int, max_sm: int | None = None) -> list[str]:
    """Canonical names of GPUs whose compute capability is in ``[min_sm, max_sm]`` (no upper bound if None)."""
    return [
        spec.name
        for spec in _TABLE
        if spec.sm >= min_sm and (max_sm is None or spec.sm <= max_sm)
    ]


def detected_gpu_names(timeout_s: float = 10.0) -> list[str] | None:
    """Raw GPU names from ``nvidia-smi --query-gpu=name --format=csv,noheader``, one per device.

    None when ``nvidia-smi`` is not on PATH, fails, times out, or lists no device.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        result = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    names = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return names or None


def host_driver_version(timeout_s: float = 10.0) -> str | None:
    """The host's NVIDIA driver version (``nvidia-smi --query-gpu=driver_version --format=csv,noheader``, first
    device), e.g. ``580.65.06``. None when ``nvidia-smi`` is absent, fails or lists no device."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        result = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not lines or not all(p.isdigit() for p in lines[0].split(".")):
        return None
    return lines[0]


def driver_older(have: str, need: str) -> bool:
    """Whether driver version ``have`` (``580.65.06``) is older than ``need`` (``580`` or ``575.51``), compared
    numerically field by field over the fields ``need`` gives."""
    def fields(v: str) -> list[int]:
        return [int(x) if x.isdigit() else 0 for x in v.strip().split(".")]

    h, n = fields(have), fields(need)
    return h[:len(n)] + [0] * (len(n) - len(h[:len(n)])) < n


def detect_gpus() -> tuple[str, int] | None:
    """The local GPU model (canonical name) and how many of that model are present, via ``nvidia-smi``.

    Counts the devices whose name matches the first device's. None when there is no ``nvidia-smi``, no
    GPU, or the first GPU is not in the table (use :func:`detected_gpu_names` to see what was reported).
    """
    names = detected_gpu_names()
    if not names:
        return None
    spec = lookup_gpu(names[0])
    if spec is None:
        return None
    count = sum(1 for raw in names if lookup_gpu(raw) is spec)
    return spec.name, count
