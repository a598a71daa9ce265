"""Stand-ins for what these machines do not have (named as stand-ins wherever a test uses them; none of them is
ever presented as a GPU run):

* :func:`serving_site` — package metadata saying TensorRT-LLM and TensorRT are installed, at given versions, as the
  NGC serving image's Python reports them (``importlib.metadata``): what the engine check reads in a container.
* :func:`stub_repository` — a packaged repository's shape (kiln.json, a tensorrt_llm config naming its engine
  under /models, the engine check script) for the launch-script tests.
* :func:`nvidia_smi` — an ``nvidia-smi`` that lists the GPUs a test chooses.
* :func:`llmapi_repository` — an llmapi repository as kiln packages it, over a stand-in checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import stat
from pathlib import Path

from kiln.triton.repository import CHECK_SCRIPT, check_engine_script

TRTLLM, TENSORRT = "1.2.1", "10.14.1.48"


def serving_site(root: Path, trtllm: str = TRTLLM, tensorrt: str = TENSORRT) -> Path:
    """A site directory (for PYTHONPATH) holding only the metadata of a TensorRT-LLM and a TensorRT install."""
    site = root / f"standin-site-{trtllm}-{tensorrt}"
    for name, version in (("tensorrt_llm", trtllm), ("tensorrt", tensorrt)):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def stub_repository(root: Path, models: tuple[str, ...] = ("tensorrt_llm",), trtllm: str = TRTLLM,
                    tensorrt: str = TENSORRT) -> Path:
    """A repository with kiln.json (engine built with ``trtllm``/``tensorrt``), the engine check script, and a
    config.pbtxt per model naming its engine where kiln names it (``/models/<model>/1/engine``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "kiln.json").write_text(json.dumps({"recipe": "stub", "target": "tensorrt",
                                                "engine": {"tensorrt_llm": trtllm, "tensorrt": tensorrt},
                                                "container": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"}))
    shutil.copy2(check_engine_script(), root / CHECK_SCRIPT)
    for model in models:
        (root / model / "1" / "engine").mkdir(parents=True, exist_ok=True)
        (root / model / "1" / "engine" / "rank0.engine").write_text("stand-in engine")
        (root / model / "config.pbtxt").write_text(
            f'name: "{model}"\nparameters {{\n  key: "gpt_model_path"\n  value {{\n'
            f'    string_value: "/models/{model}/1/engine"\n  }}\n}}\n')
    return root


#: The driver the stand-in nvidia-smi reports unless a test chooses one (CUDA 13.x's minimum is 580).
STANDIN_DRIVER = "580.65.06"


def nvidia_smi(bin_dir: Path, gpus: list[str], driver: str = STANDIN_DRIVER) -> Path:
    """A stand-in ``nvidia-smi`` in ``bin_dir`` printing ``gpus`` for ``--query-gpu=name`` and ``driver`` once per
    GPU for ``--query-gpu=driver_version`` (exit 9 when no GPU, as the real one does without a driver)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    if gpus:
        names = "\n".join(f"echo '{g}'" for g in gpus)
        drivers = "\n".join(f"echo '{driver}'" for _ in gpus)
        body = f'if [ "$1" = "--query-gpu=driver_version" ]; then\n{drivers}\nexit 0\nfi\n{names}'
    else:
        body = "echo 'NVIDIA-SMI has failed' >&2; exit 9"
    exe.write_text(f"#!/usr/bin/env bash\n# stand-in nvidia-smi (tests): no GPU is here\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe



def _hub_etag(path: Path) -> tuple[str, bool]:
    """(the hub's ETag for a file, whether it is LFS-tracked): the sha256 for weights, the git blob sha1 otherwise."""
    import hashlib

    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest(), True
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), False


@contextlib.contextmanager
def hub_server(model_dir: Path, repo_id: str, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """A STAND-IN Hugging Face hub on 127.0.0.1 serving ``model_dir`` as ``repo_id`` at ``commit`` (yields its URL,
    for ``HF_ENDPOINT`` / ``endpoint=``): only what ``huggingface_hub.snapshot_download`` asks — the revision
    (``/api/models/<repo>/revision/<rev>``), the file tree (``/api/models/<repo>/tree/<rev>``) and each file
    (``/<repo>/resolve/<rev>/<file>`` with the hub's ``X-Repo-Commit``, ``ETag``/``X-Linked-Etag`` and size headers)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import unquote, urlparse

    files = {p.name: p for p in sorted(model_dir.iterdir()) if p.is_file()}

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: bytes, headers: dict, head: bool = False) -> None:
            self.send_response(code)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _route(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            api = f"/api/models/{repo_id}/"
            if path.startswith(api + "revision/"):
                info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                        "siblings": [{"rfilename": name} for name in files]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            if path.startswith(api + "tree/"):
                tree = []
                for name, file in files.items():
                    etag, lfs = _hub_etag(file)
                    size = file.stat().st_size
                    entry = {"type": "file", "path": name, "size": size, "oid": "0" * 40 if lfs else etag}
                    if lfs:
                        entry["lfs"] = {"oid": etag, "size": size, "pointerSize": 134}
                    tree.append(entry)
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
            prefix = f"/{repo_id}/resolve/"
            if path.startswith(prefix):
                name = path[len(prefix):].split("/", 1)[1]
                if name not in files:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                etag, lfs = _hub_etag(files[name])
                headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
                if lfs:
                    headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(files[name].stat().st_size)})
                return self._send(200, files[name].read_bytes(), headers, head)
            return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)

        def do_HEAD(self):  # noqa: N802 - http.server's names
            self._route(head=True)

        def do_GET(self):  # noqa: N802
            self._route(head=False)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def hub_cache(model_dir: Path, hub_root: Path, repo_id: str) -> Path:
    """``model_dir`` put into a Hugging Face hub cache (``$HF_HOME/hub``) by huggingface_hub's own download code
    (``snapshot_download``) from the stand-in hub above: ``models--org--name/blobs/<etag>``, ``refs/main``,
    ``snapshots/<commit>/<file>`` relative symlinks ``../../blobs/<etag>``. Returns the snapshot directory."""
    from huggingface_hub import snapshot_download

    with hub_server(model_dir, repo_id) as url:
        return Path(snapshot_download(repo_id, cache_dir=hub_root, endpoint=url))


def llmapi_repository(tmp_path: Path, quant_algo: str, overrides: list[str]) -> Path:
    """An llmapi repository as kiln packages configs/tiny-llama.yaml with ``overrides``, over a stand-in checkpoint
    (config.json and hf_quant_config.json with ``quant_algo`` only: lint reads no weights)."""
    from kiln.recipe.loader import load_recipe
    from kiln.triton.llmapi_repository import write_llmapi_repository

    ckpt = tmp_path / "unified"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": quant_algo}}))
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "configs" / "tiny-llama.yaml", overrides).recipe
    out = tmp_path / "repo"
    out.mkdir()
    write_llmapi_repository(recipe, ckpt, out, 512)
    return out
