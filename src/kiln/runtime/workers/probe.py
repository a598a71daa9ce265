"""kiln engine-runtime probe: print one JSON line with the runtime's package versions, Python and GPUs.

It reads versions from package metadata and never imports tensorrt_llm (whose import prints a banner and needs
the GPU driver libraries). Run as ``python3 probe.py``; kiln parses the last line.
"""

import json
import platform

from check_engine import NAMES, version  # its sibling here: the engine check reads versions the same way

PACKAGES = {
    **NAMES,  # tensorrt_llm, tensorrt
    "nvidia-modelopt": ("nvidia-modelopt", "nvidia_modelopt"),
    "transformers": ("transformers",),
    "torch": ("torch",),
}


def gpus():
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        found.append({"name": torch.cuda.get_device_name(i), "sm": major * 10 + minor})
    return found


def main():
    report = {"packages": {key: version(names) for key, names in PACKAGES.items()},
              "python": platform.python_version(), "gpus": gpus()}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
