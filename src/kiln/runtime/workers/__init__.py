"""kiln's engine-runtime workers: standalone scripts run inside the engine runtime (the NGC TensorRT-LLM image or
a local TensorRT-LLM interpreter). They import only what that runtime has — never kiln — and talk to kiln through
a job file (JSON) in and a result file (JSON) out. kiln may import them (the math in evaluate.py is shared)."""
