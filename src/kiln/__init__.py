"""kiln: one YAML recipe to a quantized, compiled and served LLM (ModelOpt → TensorRT-LLM → Triton)."""

__version__ = "0.1.0"
