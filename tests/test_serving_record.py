"""One record of where a repository is served: kiln.json's ``serving`` (the recipe's serving.host and ports), read
by one reader (``kiln.serve.session.serving_record``), which `kiln serve REPO` uses instead of the schema's defaults.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.recipe.catalog import configs_dir
from kiln.recipe.loader import load_recipe
from kiln.serve.session import serving_record, state_file_for
from kiln.util.errors import InputError
from tests.test_cli_serve import standin_docker  # noqa: F401 - fixture used by name
from tests.test_repository import make_repo, tokenizer_dir  # noqa: F401 - fixture used by name

RECORD = ["serving.host=127.0.0.2", "serving.http_port=18100", "serving.grpc_port=18101",
          "serving.metrics_port=18102", "serving.openai_port=18103", "serving.openai_model=tensorrt_llm_bls"]


def llmapi_reference_repo(tmp: Path, overrides=RECORD) -> Path:
    """A packaged llmapi repository served by the CPU reference runtime (no engine check, so `kiln serve` gets as
    far as starting the server)."""
    from kiln.triton.llmapi_repository import write_llmapi_repository

    recipe = load_recipe(configs_dir() / "tiny-llama.yaml",
                         ["target=pytorch", "serving.llmapi_runtime=reference", *overrides]).recipe
    ckpt = tmp / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    repo = tmp / "triton_repo" / recipe.name
    repo.mkdir(parents=True)
    write_llmapi_repository(recipe, ckpt, repo, 256)
    return repo


@pytest.fixture
def captured(monkeypatch):
    """`kiln serve`'s foreground session replaced by a recorder of what it was asked to serve."""
    import kiln.serve.session as session

    seen = {}

    def fake(cfg, announce, state_file=None, timeout_s=300, openai=None):
        seen.update(cfg=cfg, openai=openai)
        return 0

    monkeypatch.setattr(session, "serve_foreground", fake)
    return seen


def test_kiln_serve_repo_serves_on_the_recorded_host_and_ports(kiln, tmp_path, captured,
                                                               tokenizer_dir):  # noqa: F811
    repo = llmapi_reference_repo(tmp_path / "llmapi")
    assert json.loads((repo / "kiln.json").read_text())["serving"] == {
        "host": "127.0.0.2", "http_port": 18100, "grpc_port": 18101, "metrics_port": 18102, "openai_port": 18103,
        "openai_model": "tensorrt_llm_bls"}
    result = kiln("serve", repo)
    assert result.exit_code == 0, result.output
    cfg = captured["cfg"]
    assert (cfg.host, cfg.http_port, cfg.grpc_port, cfg.metrics_port) == ("127.0.0.2", 18100, 18101, 18102)
    # the command line still wins over the record
    result = kiln("serve", repo, "--http-port", "19000")
    assert result.exit_code == 0, result.output
    assert (captured["cfg"].http_port, captured["cfg"].grpc_port) == (19000, 18101)
    # the OpenAI front's port and model come from the record too (an ensemble repository: kiln's front refuses a
    # target-pytorch one, whose OpenAI endpoints are trtllm-serve and Dynamo's)
    ensemble = make_repo(load_recipe(configs_dir() / "tiny-llama.yaml", RECORD).recipe, tmp_path / "ens",
                         tokenizer_dir)
    result = kiln("serve", ensemble, "--openai")
    assert result.exit_code == 0, result.output
    cfg, front = captured["cfg"], captured["openai"]
    assert (cfg.host, cfg.http_port, cfg.grpc_port, cfg.metrics_port) == ("127.0.0.2", 18100, 18101, 18102)
    assert (front.host, front.port, front.triton_model) == ("127.0.0.2", 18103, "tensorrt_llm_bls")


def test_kiln_serve_docker_publishes_the_recorded_ports(kiln, tmp_path, standin_docker, tokenizer_dir):  # noqa: F811
    recipe = load_recipe(configs_dir() / "llama-3.1-8b" / "fp8.yaml", RECORD).recipe
    repo = make_repo(recipe, tmp_path, tokenizer_dir)
    result = kiln("serve", repo, "--docker")
    assert result.exit_code == 0, result.output
    argv = json.loads(standin_docker.read_text())
    assert [a for a in argv if a.startswith("-p")] == ["-p127.0.0.2:18100:18100", "-p127.0.0.2:18101:18101",
                                                       "-p127.0.0.2:18102:18102"]


def test_the_reader_defaults_refuses_and_sees_the_running_session(tmp_path):
    repo = llmapi_reference_repo(tmp_path)
    record = serving_record(repo, state_dir=tmp_path / "state")
    assert record.recorded and record.running is None
    assert record.urls() == {"http": "http://127.0.0.2:18100", "grpc": "127.0.0.2:18101",
                             "metrics": "http://127.0.0.2:18102/metrics", "openai": "http://127.0.0.2:18103/v1"}

    # a running `kiln serve` of this repository (its state file, a live pid): its URLs win
    state = state_file_for(repo, tmp_path / "state")
    state.parent.mkdir()
    urls = {"http": "http://127.0.0.2:19000", "grpc": "127.0.0.2:19001", "metrics": "http://127.0.0.2:19002/metrics"}
    state.write_text(json.dumps({"pid": os.getpid(), "repo": str(repo.resolve()), "urls": urls}))
    assert serving_record(repo, state_dir=tmp_path / "state").urls() == urls
    state.write_text(json.dumps({"pid": 2 ** 22 + 12345, "repo": str(repo.resolve()), "urls": urls}))  # not alive
    assert serving_record(repo, state_dir=tmp_path / "state").running is None

    info_file = repo / "kiln.json"
    info = json.loads(info_file.read_text())
    del info["serving"]  # packaged by an older kiln: the schema's defaults, and it says so
    info_file.write_text(json.dumps(info))
    old = serving_record(repo, state_dir=tmp_path / "state")
    assert not old.recorded and (old.host, old.http_port, old.grpc_port) == ("127.0.0.1", 8000, 8001)
    info["serving"] = {"grpc_port": "8001"}
    info_file.write_text(json.dumps(info))
    with pytest.raises(InputError, match=r"kiln\.json: serving\.grpc_port is '8001', not a port"):
        serving_record(repo)
