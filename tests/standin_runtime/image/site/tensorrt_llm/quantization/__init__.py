"""STAND-IN tensorrt_llm.quantization (tests only)."""

from tensorrt_llm.quantization.quantize_by_modelopt import quantize_and_export  # noqa: F401
