"""A real ``tritonserver`` (the one in nvidia-pytriton) serving kiln's Python models on the CPU.

The repository is written by hand here (preprocessing + reference ``tensorrt_llm`` + postprocessing +
ensemble + ``tensorrt_llm_bls``) around a tiny INT8-SmoothQuant Llama built in the test's temp folder; the
served greedy output must equal Hugging Face ``generate`` on the same restored model, over HTTP
``/generate`` and gRPC streaming, through the ensemble and the BLS model.
"""

from __future__ import annotations

import glob
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from triton_harness import build_tiny_model, hf_greedy, load_restored_model

from kiln.serve.client import GenerationError, generate_http, generate_stream
from kiln.serve.server import ServerConfig, ServerError, TritonServer, find_tritonserver, free_port, tail
from kiln.triton.repository import install_python_model
from kiln.triton.upstream import MODELS as UPSTREAM

PROMPTS = ["The quick brown fox", "Zürich café", "Beautiful is better than"]
MAX_TOKENS = 24


# ============================================================================ a hand-made repository
def _tensor(name: str, dtype: str, dims: str, optional: bool = False, scalar: bool = False) -> str:
    extra = (" reshape: { shape: [ ] }" if scalar else "") + (" optional: true" if optional else "")
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {dims} ]{extra} }}'


def _params(**values: object) -> str:
    return "\n".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in values.items()
    )


def _model(name: str, backend: str, inputs: list[str], outputs: list[str], params: str, decoupled: bool) -> str:
    policy = f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}\n" if decoupled else ""
    sep = ",\n"
    return (
        f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: 8\n{policy}'
        f"input [\n{sep.join(inputs)}\n]\noutput [\n{sep.join(outputs)}\n]\n"
        f"instance_group [ {{ count: 1 kind: KIND_CPU }} ]\n{params}\n"
    )


def _upstream_tensor(t) -> str:
    """One tensor of upstream's contract as config text (templated types filled as kiln fills them)."""
    from kiln.triton.repository import FILLED_TYPES

    extra = (" reshape: { shape: [ ] }" if t.reshape == () else "") + (" optional: true" if t.optional else "")
    extra += " allow_ragged_batch: true" if t.allow_ragged_batch else ""
    dims = ", ".join(map(str, t.dims))
    return f'  {{ name: "{t.name}" data_type: {FILLED_TYPES.get(t.data_type, t.data_type)} dims: [ {dims} ]{extra} }}'


#: upstream's tensorrt_llm inputs: the BLS passes on everything preprocessing returns, as upstream's BLS does
LLM_INPUTS = [_upstream_tensor(t) for t in UPSTREAM["tensorrt_llm"].inputs]
LLM_OUTPUTS = [
    _tensor("output_ids", "TYPE_INT32", "-1, -1"),
    _tensor("sequence_length", "TYPE_INT32", "-1"),
    _tensor("cum_log_probs", "TYPE_FP32", "-1"),
    _tensor("output_log_probs", "TYPE_FP32", "-1, -1"),
    _tensor("batch_index", "TYPE_INT32", "1"),  # upstream's tensorrt_llm declares it; the BLS asks for it
]
#: ensemble / BLS request inputs besides text_input and max_tokens.
CLIENT_INPUTS = [
    _tensor("stream", "TYPE_BOOL", "1", optional=True),
    _tensor("bad_words", "TYPE_STRING", "-1", optional=True),
    _tensor("stop_words", "TYPE_STRING", "-1", optional=True),
    _tensor("end_id", "TYPE_INT32", "1", optional=True),
    _tensor("pad_id", "TYPE_INT32", "1", optional=True),
    _tensor("top_k", "TYPE_INT32", "1", optional=True),
    _tensor("top_p", "TYPE_FP32", "1", optional=True),
    _tensor("temperature", "TYPE_FP32", "1", optional=True),
    _tensor("min_tokens", "TYPE_INT32", "1", optional=True),
    _tensor("seed", "TYPE_UINT64", "1", optional=True),
    _tensor("return_log_probs", "TYPE_BOOL", "1", optional=True),
    _tensor("exclude_input_in_output", "TYPE_BOOL", "1", optional=True),
]
#: ensemble input -> tensorrt_llm input (the optional ones passed straight through).
PASS_THROUGH = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "temperature": "temperature",
    "min_tokens": "min_tokens",
    "seed": "seed",
    "return_log_probs": "return_log_probs",
    "exclude_input_in_output": "exclude_input_in_output",
    "stream": "streaming",
}


def _map(kind: str, pairs: dict[str, str]) -> str:
    return "\n".join(f'      {kind} {{ key: "{k}" value: "{v}" }}' for k, v in pairs.items())


def ensemble_config() -> str:
    pre_in = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
              "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id"}
    pre_out = {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
               "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
               "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "OUT_END_ID": "_PREPROCESSOR_END_ID",
               "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"}
    llm_in = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
              "request_output_len": "_REQUEST_OUTPUT_LEN", "bad_words_list": "_BAD_WORDS_IDS",
              "stop_words_list": "_STOP_WORDS_IDS", "end_id": "_PREPROCESSOR_END_ID",
              "pad_id": "_PREPROCESSOR_PAD_ID", **{v: k for k, v in PASS_THROUGH.items()}}
    llm_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
               "cum_log_probs": "cum_log_probs"}
    inputs = [_tensor("text_input", "TYPE_STRING", "1"), _tensor("max_tokens", "TYPE_INT32", "1"), *CLIENT_INPUTS]
    outputs = [_tensor("text_output", "TYPE_STRING", "-1"), _tensor("cum_log_probs", "TYPE_FP32", "-1")]
    steps = [
        ("preprocessing", _map("input_map", pre_in), _map("output_map", pre_out)),
        ("tensorrt_llm", _map("input_map", llm_in), _map("output_map", llm_out)),
        ("postprocessing",
         _map("input_map", {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"}),
         _map("output_map", {"OUTPUT": "text_output"})),
    ]
    sep = ",\n"
    body = sep.join(f'    {{\n      model_name: "{m}"\n      model_version: -1\n{i}\n{o}\n    }}' for m, i, o in steps)
    return (
        f'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        f"input [\n{sep.join(inputs)}\n]\noutput [\n{sep.join(outputs)}\n]\n"
        f"ensemble_scheduling {{\n  step [\n{body}\n  ]\n}}\n"
    )


def write_repository(root: Path, model_dir: Path, decoupled: bool = True, draft_dir: Path | None = None) -> Path:
    """A five-model repository (six with a draft model) serving ``model_dir`` with kiln's Python models."""
    pre_inputs = [
        _tensor("QUERY", "TYPE_STRING", "1"),
        _tensor("REQUEST_OUTPUT_LEN", "TYPE_INT32", "1"),
        _tensor("BAD_WORDS_DICT", "TYPE_STRING", "-1", optional=True),
        _tensor("STOP_WORDS_DICT", "TYPE_STRING", "-1", optional=True),
        _tensor("END_ID", "TYPE_INT32", "1", optional=True),
        _tensor("PAD_ID", "TYPE_INT32", "1", optional=True),
    ]
    # every output upstream's preprocessing declares: the BLS asks for them by name, as upstream's BLS does
    pre_outputs = [_tensor(t.name, t.data_type, ", ".join(map(str, t.dims))) for t in UPSTREAM["preprocessing"].outputs]
    llm_params = dict(max_tokens_in_paged_kv_cache=1024, tokens_per_block=16, max_num_tokens=256, num_threads=2)
    models = {
        "preprocessing": ("preprocessing", _model(
            "preprocessing", "python", pre_inputs, pre_outputs,
            _params(tokenizer_dir=model_dir, add_special_tokens="true", max_input_len=128, max_seq_len=4096), False)),
        "postprocessing": ("postprocessing", _model(
            "postprocessing", "python",
            [_tensor("TOKENS_BATCH", "TYPE_INT32", "-1, -1"), _tensor("SEQUENCE_LENGTH", "TYPE_INT32", "-1")],
            [_tensor("OUTPUT", "TYPE_STRING", "-1")],
            _params(tokenizer_dir=model_dir, skip_special_tokens="true"), False)),
        "tensorrt_llm": ("reference", _model(
            "tensorrt_llm", "python", LLM_INPUTS, LLM_OUTPUTS, _params(model_dir=model_dir, **llm_params), decoupled)),
        "tensorrt_llm_bls": ("bls", _model(
            "tensorrt_llm_bls", "python",
            [_tensor("text_input", "TYPE_STRING", "1"), _tensor("max_tokens", "TYPE_INT32", "1"), *CLIENT_INPUTS,
             _tensor("num_draft_tokens", "TYPE_INT32", "1", optional=True)],
            [_tensor("text_output", "TYPE_STRING", "-1")],
            _params(tensorrt_llm_model_name="tensorrt_llm", accumulate_tokens="false",
                    **({"tensorrt_llm_draft_model_name": "tensorrt_llm_draft"} if draft_dir else {})),
            decoupled)),
    }
    if draft_dir is not None:
        models["tensorrt_llm_draft"] = ("reference", _model(
            "tensorrt_llm_draft", "python", LLM_INPUTS, LLM_OUTPUTS,
            _params(model_dir=draft_dir, **llm_params), decoupled))
    for name, (source, config) in models.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(config)
        install_python_model(source, root / name)  # model.py and kiln_triton_utils.py, as kiln ships them
    (root / "ensemble" / "1").mkdir(parents=True, exist_ok=True)
    (root / "ensemble" / "config.pbtxt").write_text(ensemble_config())
    return root


# ============================================================================ launcher, without a model
def _echo_repo(root: Path, fail: bool = False) -> Path:
    """A one-model repository whose Python model echoes its input (or fails to load)."""
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(
        'name: "echo"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )
    body = "        raise RuntimeError('kiln-test: this model refuses to load')\n" if fail else "        pass\n"
    (root / "echo" / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n\n"
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n" + body +
        "    def execute(self, requests):\n"
        "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', pb_utils.get_input_tensor_by_name(r, 'X')"
        ".as_numpy())]) for r in requests]\n"
    )
    return root


def _config(repo: Path, **kwargs: object) -> ServerConfig:
    return ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **kwargs)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    assert isinstance(port, int) and 1024 <= port <= 65535  # a real, unprivileged port (never 0: "any")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # OSError (in use) fails the test
        assert sock.getsockname()[1] == port
        sock.listen()
        assert free_port() != port  # a port held by a listener is not handed out again


def test_find_tritonserver_prefers_path_then_pytriton(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import kiln.serve.server as srv

    fake = tmp_path / "tritonserver"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_tritonserver() == fake
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(srv, "_pytriton_root", lambda: None)
    with pytest.raises(ServerError, match=r"pip install kiln\[serve\]"):
        find_tritonserver()


def test_environment_puts_interpreter_libdir_and_bin_first() -> None:
    import sys
    import sysconfig

    from kiln.serve.server import server_environment

    env = server_environment({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"}, lib_dirs=("/libs",))
    libdir = sysconfig.get_config_var("LIBDIR")
    assert env["LD_LIBRARY_PATH"].split(":") == [libdir, "/libs", "/opt/x"]
    assert env["PATH"].split(":") == [str(Path(sys.executable).parent), "/usr/bin"]


def test_backend_directory_layout(tmp_path: Path) -> None:
    pytest.importorskip("pytriton", reason="needs nvidia-pytriton (pip install kiln[serve])")
    from kiln.serve.server import python_backend_dir

    first = python_backend_dir(cache_dir=tmp_path)
    names = sorted(p.name for p in (first / "python").iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert python_backend_dir(cache_dir=tmp_path) == first, "laid out once, then reused"


def test_command_has_kiln_flags_and_unique_shm_prefix(tmp_path: Path) -> None:
    pytest.importorskip("pytriton", reason="needs nvidia-pytriton (pip install kiln[serve])")
    a, b = TritonServer(_config(tmp_path, extra_args=("--log-verbose=1",))), TritonServer(_config(tmp_path))
    cmd = a.command()
    for flag in ("--disable-auto-complete-config", "--allow-gpu-metrics=false", "--exit-on-error=true",
                 "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"):
        assert flag in cmd
    assert cmd[-1] == "--log-verbose=1", "extra args come last"
    assert any(c.startswith("--backend-directory=") for c in cmd)
    assert a.shm_prefix != b.shm_prefix and a.shm_prefix.startswith("triton_python_backend_shm_region_")


def test_missing_repository_is_an_input_error(tmp_path: Path) -> None:
    from kiln.util.errors import InputError

    with pytest.raises(InputError, match="does not exist"):
        TritonServer(_config(tmp_path / "nope")).start()


# The child: starts `sleep` the way TritonServer starts tritonserver (optionally with setpriv hidden), prints
# its pid, and waits to be SIGKILLed.
_ORPHAN_PARENT = """
import shutil, subprocess, sys, time
from kiln.serve import server
if sys.argv[1] == "no-setpriv":
    real = shutil.which
    server.shutil.which = lambda name, *a, **k: None if name == "setpriv" else real(name, *a, **k)
cmd = server.die_with_parent(["sleep", "60"])
assert cmd[0].endswith("setpriv") if sys.argv[1] == "setpriv" else cmd[:2] == [sys.executable, "-c"], cmd
proc = subprocess.Popen(cmd, start_new_session=True)
print(proc.pid, flush=True)
time.sleep(60)
"""


def test_without_setpriv_a_starter_that_died_before_the_flag_was_set_is_not_outlived() -> None:
    import subprocess
    import sys

    from kiln.serve import server

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    started = time.monotonic()  # a starter pid that is not the shim's parent (a process that already exited)
    run = subprocess.run([sys.executable, "-c", server._PDEATHSIG_EXEC, gone.stdout.strip(), "sleep", "60"],
                         timeout=30)
    assert run.returncode == 1 and time.monotonic() - started < 20  # not its parent: it never execs


def test_a_setpriv_without_pdeathsig_is_not_used(tmp_path: Path) -> None:
    """util-linux before 2.33 (RHEL 8) has a setpriv that refuses --pdeathsig: the interpreter shim is used instead,
    never a wrapper that would stop every server from starting."""
    import sys

    from kiln.serve import server

    old = tmp_path / "setpriv"
    old.write_text("#!/bin/sh\necho 'setpriv: unrecognized option --pdeathsig' >&2\nexit 1\n")
    old.chmod(0o755)
    assert server._setpriv_with_pdeathsig(str(old)) is None
    real = server.shutil.which("setpriv")
    if real is not None:
        assert server._setpriv_with_pdeathsig(real) == real


@pytest.mark.parametrize("way", ["setpriv", "no-setpriv"])
def test_a_started_server_dies_with_the_process_that_started_it(way: str) -> None:
    """No orphaned servers: SIGKILL the starter and its child goes too, with or without util-linux's setpriv."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    if way == "setpriv" and shutil.which("setpriv") is None:
        pytest.skip("util-linux's setpriv is not on PATH")
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, way], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}/comm").read_text().strip() != "sleep":  # the child has become the server
        assert time.monotonic() < deadline, "the child never exec'd"
        time.sleep(0.01)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie whose parent died is reaped by init; /proc shows it gone or 'Z'
        state = Path(f"/proc/{child}/stat").read_text().split(") ")[-1][:1] if Path(f"/proc/{child}").exists() else "X"
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the child {child} outlived the process that started it")


@pytest.mark.integration
def test_server_starts_serves_stops_and_cleans_shared_memory(tmp_path: Path) -> None:
    import numpy as np
    import tritonclient.http as httpclient

    server = TritonServer(_config(_echo_repo(tmp_path / "repo"), log_file=tmp_path / "server.log"))
    with server:
        assert server.is_running() and server.startup_s is not None
        client = httpclient.InferenceServerClient(server.urls()["http"].removeprefix("http://"))
        x = httpclient.InferInput("X", [1, 3], "INT32")
        x.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.int32))
        assert client.infer("echo", [x]).as_numpy("Y").tolist() == [[1, 2, 3]]
        client.close()  # an open connection would hold the server's shutdown for --exit-timeout-secs
        assert glob.glob(f"/dev/shm/{server.shm_prefix}*"), "the Python backend uses our shm prefix"
        server.start()  # a no-op while running
        pid = server.proc.pid
    assert not server.is_running()
    assert not glob.glob(f"/dev/shm/{server.shm_prefix}*")
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


@pytest.mark.integration
def test_model_that_fails_to_load_raises_with_the_log_tail(tmp_path: Path) -> None:
    server = TritonServer(_config(_echo_repo(tmp_path / "repo", fail=True)))
    with pytest.raises(ServerError, match="this model refuses to load") as info:
        server.start(timeout_s=120)
    assert "could not load a model" in str(info.value) or "exited with code" in str(info.value)
    assert not server.is_running()
    assert not glob.glob(f"/dev/shm/{server.shm_prefix}*")


# ============================================================================ the full repository
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonServer, Path]]:
    pytest.importorskip("pytriton", reason="needs the tritonserver in nvidia-pytriton (pip install kiln[serve])")
    model_dir = build_tiny_model(tmp_path_factory.getbasetemp() / "kiln-tiny-int8sq")
    repo = write_repository(tmp_path_factory.mktemp("triton") / "repo", model_dir)
    server = TritonServer(_config(repo, log_file=repo.parent / "server.log"))
    server.start(timeout_s=300)
    try:
        yield server, model_dir
    finally:
        server.stop()
        print(f"\n[kiln] tritonserver ready in {server.startup_s:.1f}s; "
              + " ".join(line.strip() for line in tail(repo.parent / "server.log", 400).splitlines()
                         if "loaded in" in line))


@pytest.fixture(scope="module")
def expected(served: tuple[TritonServer, Path]) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (prompt ids, HF greedy continuation) on a freshly restored copy of the served model."""
    from tokenizers import Tokenizer

    _, model_dir = served
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = load_restored_model(model_dir)
    out = {}
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        out[prompt] = (ids, hf_greedy(model, ids, MAX_TOKENS))
    return out


def _decode(model_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True)


@pytest.mark.integration
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_http_generate_equals_hf_generate(served: tuple[TritonServer, Path], expected: dict, model: str) -> None:
    server, model_dir = served
    for prompt, (ids, continuation) in expected.items():
        text = generate_http(server.urls()["http"], prompt, MAX_TOKENS, model=model)
        assert text == _decode(model_dir, ids + continuation), "the prompt comes back too by default"
        text = generate_http(server.urls()["http"], prompt, MAX_TOKENS, model=model, exclude_input_in_output=True)
        assert text == _decode(model_dir, continuation)


@pytest.mark.integration
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_grpc_stream_equals_hf_generate(served: tuple[TritonServer, Path], expected: dict, model: str) -> None:
    server, model_dir = served
    for prompt, (_, continuation) in expected.items():
        pieces = list(generate_stream(server.urls()["grpc"], prompt, MAX_TOKENS, model=model))
        assert "".join(pieces) == _decode(model_dir, continuation)
        assert len(pieces) > 1 or len(continuation) <= 1, "tokens arrive as they are generated"


@pytest.mark.integration
def test_concurrent_streams_are_each_correct(served: tuple[TritonServer, Path], expected: dict) -> None:
    server, model_dir = served
    results: dict[int, str] = {}
    prompts = list(expected) * 2

    def run(i: int) -> None:
        results[i] = "".join(generate_stream(server.urls()["grpc"], prompts[i], MAX_TOKENS))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert {i: results.get(i) for i in range(len(prompts))} == {
        i: _decode(model_dir, expected[p][1]) for i, p in enumerate(prompts)
    }


@pytest.mark.integration
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(
    served: tuple[TritonServer, Path], expected: dict
) -> None:
    server, model_dir = served
    urls = server.urls()
    with pytest.raises(GenerationError, match="max_tokens must be at least 1"):
        generate_http(urls["http"], "hello", 0)
    with pytest.raises(GenerationError, match="max_input_len of 128"):
        list(generate_stream(urls["grpc"], "hello " * 300, 4))
    with pytest.raises(GenerationError, match="KV-cache tokens"):
        generate_http(urls["http"], "hello", 1100, model="tensorrt_llm_bls")
    prompt, (ids, continuation) = next(iter(expected.items()))
    assert generate_http(urls["http"], prompt, MAX_TOKENS) == _decode(model_dir, ids + continuation)
    assert server.is_running()


@pytest.mark.integration
def test_cancelling_a_bls_stream_stops_the_model_request(served: tuple[TritonServer, Path]) -> None:
    """Triton 2.51's BLS response iterator has no cancel(): the BLS stops the request with upstream's `stop`."""
    server, _ = served
    stream = generate_stream(server.urls()["grpc"], "The quick", 900, model="tensorrt_llm_bls", end_id=-1)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # cancels the gRPC stream
    deadline = time.monotonic() + 10
    while "stopped by a stop request" not in server.log_tail(400) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "stopped by a stop request" in server.log_tail(400)


@pytest.mark.integration
def test_seeded_sampling_and_stop_words_through_the_ensemble(
    served: tuple[TritonServer, Path], expected: dict
) -> None:
    server, model_dir = served
    url = server.urls()["grpc"]
    a = "".join(generate_stream(url, "The quick", 16, top_k=40, temperature=1.3, seed=5))
    assert a == "".join(generate_stream(url, "The quick", 16, top_k=40, temperature=1.3, seed=5))
    prompt, (_, continuation) = next(iter(expected.items()))
    full = _decode(model_dir, continuation)
    stop = _decode(model_dir, continuation[3:5])
    text = "".join(generate_stream(url, prompt, MAX_TOKENS, stop_words=[stop]))
    assert text.endswith(stop) and len(text) < len(full) and full.startswith(text)
    http_text = generate_http(
        server.urls()["http"], prompt, MAX_TOKENS, stop_words=[stop], exclude_input_in_output=True
    )
    assert http_text == text
