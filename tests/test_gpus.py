"""The GPU table: lookups, datasheet figures, and detection through a fake nvidia-smi."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from kiln.recipe.gpus import GPUS, GPUSpec, detect_gpus, detected_gpu_names, gpus_with_sm, known_gpu_names, lookup_gpu

REQUIRED = ("A100-40GB", "A100-80GB", "L40S", "H100-SXM", "H100-PCIe", "H200", "B200", "RTX-4090")


def test_table_has_the_required_gpus_in_canonical_names() -> None:
    for name in REQUIRED:
        assert name in GPUS
        assert GPUS[name].name == name
    assert known_gpu_names() == list(GPUS)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("H100", "H100-SXM"),
        ("h100-sxm5-80gb", "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),  # what nvidia-smi prints for an H100 SXM
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("nvidia h200", "H200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA L40S", "L40S"),
    ],
)
def test_lookup_accepts_aliases_and_nvidia_smi_names(query: str, expected: str) -> None:
    spec = lookup_gpu(query)
    assert spec is not None and spec.name == expected


def test_lookup_unknown_or_ambiguous_is_none() -> None:
    assert lookup_gpu("H300") is None
    assert lookup_gpu("A100") is None  # 40GB or 80GB: ambiguous on purpose
    assert lookup_gpu("") is None


def test_dense_figures_from_datasheets() -> None:
    h100 = GPUS["H100-SXM"]
    # Datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense; FP8 3,958 sparse -> 1,979 dense.
    assert h100.tflops["bf16"] == 989.0
    assert h100.tflops["fp8"] == 1979.0
    assert h100.bandwidth_gbs == 3350.0
    assert h100.sm == 90
    a100 = GPUS["A100-80GB"]
    assert a100.tflops == {"fp16": 312.0, "bf16": 312.0, "int8": 624.0}  # no FP8 on Ampere
    assert a100.bandwidth_gbs == 2039.0
    assert GPUS["A100-40GB"].bandwidth_gbs == 1555.0
    assert GPUS["H200"].bandwidth_gbs == 4800.0
    assert GPUS["B200"].tflops["fp4"] == 9000.0
    assert GPUS["RTX-4090"].tflops["fp8"] == 330.3


def test_only_blackwell_has_fp4_and_only_sm89_plus_has_fp8() -> None:
    for spec in GPUS.values():
        assert ("fp4" in spec.tflops) == (spec.sm >= 100), spec.name
        assert ("fp8" in spec.tflops) == (spec.sm >= 89), spec.name
        assert spec.supports("bf16")
        assert spec.memory_gib > 0 and spec.bandwidth_gbs > 0 and spec.source


def test_memory_is_what_the_driver_reports() -> None:
    assert GPUS["A100-80GB"].memory_gib == 80.0  # 81,920 MiB
    assert GPUS["H100-SXM"].memory_gib == 79.65  # 81,559 MiB / 1024 = 79.647
    assert GPUS["H200"].memory_gib == 140.4  # 143,771 MiB / 1024 = 140.40


def test_gpus_with_sm_ranges() -> None:
    assert "A100-80GB" not in gpus_with_sm(89)
    assert {"L40S", "H100-SXM", "H200", "B200", "RTX-4090"} <= set(gpus_with_sm(89))
    assert gpus_with_sm(100) == ["B200", "GB200"]
    assert set(gpus_with_sm(80, 89)) == {"A100-40GB", "A100-80GB", "A100-80GB-PCIe", "L40S", "L4", "RTX-4090"}
    assert gpus_with_sm(120) == []


def test_spec_is_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GPUS["H100-SXM"].sm = 80  # type: ignore[misc]
    assert isinstance(GPUS["H100-SXM"], GPUSpec)


def _fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin{os.pathsep}/bin")


def test_detect_counts_gpus_of_the_first_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch, 'printf "NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n"')
    assert detect_gpus() == ("H100-SXM", 2)
    assert detected_gpu_names() == ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]


def test_detect_unknown_gpu_is_none_but_name_is_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch, 'echo "NVIDIA Quadro Mystery"')
    assert detect_gpus() is None
    assert detected_gpu_names() == ["NVIDIA Quadro Mystery"]


def test_detect_failing_or_empty_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch, 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    assert detect_gpus() is None
    _fake_smi(tmp_path, monkeypatch, "exit 0")
    assert detect_gpus() is None


def test_detect_without_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi
    assert detect_gpus() is None


def test_interconnects_are_the_published_figures() -> None:
    # Per GPU and direction: NVLink 3 (12 links) 600 GB/s both ways -> 300; NVLink 4 (18 links) 900 -> 450;
    # NVLink 5 1.8 TB/s -> 900; PCIe x16 Gen4 32 GB/s, Gen5 64 GB/s. Latency: TensorRT-LLM's custom all-reduce,
    # 8 KB on 2 GPUs, as NVIDIA timed it (aiconfigurator @095f58a5).
    expected = {
        "A100-80GB": ("NVLink 3", 300.0, 4.7), "H100-SXM": ("NVLink 4", 450.0, 2.8), "H200": ("NVLink 4", 450.0, 2.8),
        "B200": ("NVLink 5", 900.0, 4.8), "GB200": ("NVLink 5", 900.0, 4.8), "L40S": ("PCIe 4.0 x16", 32.0, 7.7),
        "L4": ("PCIe 4.0 x16", 32.0, 7.7), "RTX-4090": ("PCIe 4.0 x16", 32.0, 7.7),
        "A100-80GB-PCIe": ("PCIe 4.0 x16", 32.0, 7.7), "H100-PCIe": ("PCIe 5.0 x16", 64.0, 7.7),
    }
    for name, (kind, gbs, latency) in expected.items():
        link = GPUS[name].interconnect
        assert link is not None and (link.kind, link.gbs, link.latency_us) == (kind, gbs, latency), name
    for spec in GPUS.values():
        assert spec.interconnect is not None and "aiconfigurator" in spec.interconnect.source, spec.name
