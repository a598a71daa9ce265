"""STAND-IN tensorrt_llm (tests only): just what kiln's engine-runtime workers import, implemented with the
ModelOpt installed on this CPU machine. Never a GPU run, never TensorRT-LLM itself."""
