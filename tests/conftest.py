"""Shared test fixtures: where the repository and its shipped recipes are, and a CLI runner.

Keep this small: fixtures used by one test module belong in that module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner, Result

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"


def shipped_recipes() -> list[Path]:
    """Every shipped recipe, found recursively under configs/ (sweep files under configs/sweeps/ are not
    recipes). Never a hand-kept list: a recipe added anywhere under configs/ is picked up."""
    return sorted(p for p in CONFIGS.rglob("*.yaml") if "sweeps" not in p.relative_to(CONFIGS).parts)


def recipe_id(path: Path) -> str:
    """A readable pytest id for a shipped recipe: its path under configs/."""
    return str(path.relative_to(CONFIGS))


@pytest.fixture
def write_recipe(tmp_path: Path) -> Callable[..., Path]:
    """Write recipe text to a file under tmp_path (default name recipe.yaml) and return its path."""

    def write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    return write


@pytest.fixture
def kiln() -> Callable[..., Result]:
    """Run the `kiln` CLI in-process: ``kiln("validate", path)`` returns click's Result (stdout and stderr
    both in ``.output``). Exceptions are caught by the runner, so a test sees them as ``.exception``."""
    from kiln.cli.main import cli

    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(cli, [str(a) for a in args], prog_name="kiln", catch_exceptions=True)

    return invoke


# ------------------------------------------------------------------ the default recipe, built and served once
@pytest.fixture(scope="session")
def default_build(tmp_path_factory: pytest.TempPathFactory):
    """The default recipe (configs/tiny-llama.yaml: the built-in model, INT4 AWQ, reference target) built once
    by the real pipeline for the whole session: ``(loaded recipe, layout, packaged repository)``.

    Shared read-only by every module that needs a real kiln repository (end-to-end, served greedy output, the
    serving commands); a test that changes files copies the repository first."""
    from kiln.pipeline.runner import Layout, run
    from kiln.recipe.loader import load_recipe

    root = tmp_path_factory.mktemp("default-build")
    layout = Layout(root / "build", root / "triton_repo")
    loaded = load_recipe(CONFIGS / "tiny-llama.yaml")
    summary = run(loaded, layout, progress=False)
    assert summary.failure is None, summary.failure
    return loaded, layout, layout.repo_root / loaded.recipe.name


@pytest.fixture(scope="session")
def default_server(default_build):
    """A real tritonserver serving the default recipe's repository, started once for the session (idle, it
    costs no CPU). Tests only send requests to it; none stops or reconfigures it."""
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    _, _, repo = default_build
    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with TritonServer(cfg) as server:
        yield server


class HFGreedy:
    """Hugging Face ``generate`` (greedy) on the default build's checkpoint, as the reference runtime loads it:
    ``quantized=True`` restores the ModelOpt state (``mto.restore``), ``False`` is the unquantized model.
    Results are cached per (prompt, max_tokens, quantized)."""

    def __init__(self, repo: Path) -> None:
        self.ckpt = repo / "tensorrt_llm" / "1" / "checkpoint"
        self.tokenizer_file = repo / "preprocessing" / "1" / "tokenizer" / "tokenizer.json"
        self._models: dict[bool, object] = {}
        self._cache: dict[tuple[str, int, bool], str] = {}

    def _model(self, quantized: bool):
        if quantized not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=torch.float32).eval()
            if quantized:
                import modelopt.torch.opt as mto

                mto.restore(model, str(self.ckpt / "modelopt_state.pth"))
            self._models[quantized] = model
        return self._models[quantized]

    def __call__(self, prompt: str, max_tokens: int, quantized: bool = True) -> str:
        key = (prompt, max_tokens, quantized)
        if key not in self._cache:
            import torch
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(self.tokenizer_file))
            ids = torch.tensor([tok.encode(prompt, add_special_tokens=True).ids])
            with torch.no_grad():
                out = self._model(quantized).generate(ids, attention_mask=torch.ones_like(ids),
                                                      max_new_tokens=max_tokens, do_sample=False)
            self._cache[key] = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_greedy(default_build) -> HFGreedy:
    """Greedy completions from Hugging Face ``generate`` on the default build's model (see :class:`HFGreedy`)."""
    return HFGreedy(default_build[2])


# Shared by test_end_to_end, test_client_replay and test_openai: the same session build and server under the
# names those modules use, plus the non-streaming repackaging and greedy references by token ids.
@pytest.fixture(scope="session")
def tiny_build(default_build):
    """configs/tiny-llama.yaml built by the pipeline (the session's one default build)."""
    return default_build


def _serve(repo: Path):
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    cfg = ServerConfig(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_file=repo.parent / f"{repo.name}-server.log")
    return TritonServer(cfg)


@pytest.fixture(scope="session")
def tiny_server(default_server):
    """A real tritonserver serving the default recipe (decoupled: streaming clients): the session's one."""
    return default_server


@pytest.fixture(scope="session")
def tiny_server_nonstreaming(tiny_build):
    """The default recipe repackaged with serving.streaming=false (only the package step runs), served."""
    from kiln.pipeline.runner import Layout, run
    from kiln.recipe.loader import load_recipe

    _, layout, repo = tiny_build
    loaded = load_recipe(CONFIGS / "tiny-llama.yaml", overrides=("serving.streaming=false",))
    other = Layout(layout.build_root, repo.parent.parent / "triton_repo_nonstreaming")
    summary = run(loaded, other, progress=False)
    assert summary.failure is None, summary.failure
    with _serve(other.repo_root / loaded.recipe.name) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_greedy(tiny_build):
    """``greedy(prompt or prompt ids, max_tokens) -> (prompt ids, continuation ids, continuation text)``: Hugging
    Face greedy generate on the served quantized model (ModelOpt state restored), decoded as the server does."""
    import modelopt.torch.opt as mto
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    _, _, repo = tiny_build
    ckpt = repo / "tensorrt_llm" / "1" / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    mto.restore(model, str(ckpt / "modelopt_state.pth"))
    tok = Tokenizer.from_file(str(repo / "preprocessing" / "1" / "tokenizer" / "tokenizer.json"))
    cache: dict = {}

    def greedy(prompt, max_tokens: int):
        ids = tok.encode(prompt, add_special_tokens=True).ids if isinstance(prompt, str) else list(prompt)
        key = (tuple(ids), max_tokens)
        if key not in cache:
            with torch.no_grad():
                x = torch.tensor([ids])
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)
            gen = out[0, len(ids):].tolist()
            eos = model.generation_config.eos_token_id
            gen = gen[:-1] if gen and gen[-1] == eos else gen
            cache[key] = (ids, gen, tok.decode(gen, skip_special_tokens=True))
        return cache[key]

    return greedy


# ------------------------------------------------------------------ target pytorch, built and served once
@pytest.fixture(scope="session")
def pytorch_build(tmp_path_factory: pytest.TempPathFactory):
    """configs/tiny-llama.yaml with --set target=pytorch built once for the session (ModelOpt's unified checkpoint,
    Triton's llmapi repository with kiln's CPU reference runtime): ``(loaded recipe, layout, repository)``. Shared
    read-only by the pytorch-target tests (tests/test_pytorch_target.py, tests/test_dynamo_serve.py)."""
    from kiln.pipeline.runner import Layout, run
    from kiln.recipe.loader import load_recipe

    root = tmp_path_factory.mktemp("pytorch")
    layout = Layout(root / "build", root / "triton_repo")
    loaded = load_recipe(CONFIGS / "tiny-llama.yaml", ["target=pytorch"])
    summary = run(loaded, layout, progress=False)
    assert summary.failure is None, summary.failure
    return loaded, layout, layout.repo_root / loaded.recipe.name


@pytest.fixture(scope="session")
def pytorch_server(pytorch_build):
    """A real tritonserver serving the session's pytorch build (the Triton llmapi path), started once."""
    from kiln.serve.server import ServerConfig, TritonServer, free_port

    cfg = ServerConfig(repo=pytorch_build[2], http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with TritonServer(cfg) as server:
        yield server


# ------------------------------------------------------------------ the image's Python environment (image_env)
def pytest_report_header(config):
    from tests import image_env

    return image_env.header()


def pytest_collection_modifyitems(config, items):
    """The image-environment matrix (marker image_env_matrix) runs only when -m names image_env; the default run
    keeps the representative image_env cases."""
    if "image_env" in (config.option.markexpr or ""):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("image_env_matrix") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def image_python() -> Path:
    """The image environment's python (tests/image_env.py); the test skips, naming the command, without it."""
    from tests import image_env

    found = image_env.python()
    if found is None:
        pytest.skip(image_env.missing_reason())
    return found


@pytest.fixture(scope="session")
def openai_api(tiny_server, tiny_build):
    """kiln's OpenAI server in front of the session's tritonserver (shared by test_openai and test_openai_tools):
    ``(base_url ending in /v1, served model name)``."""
    from kiln.serve.openai import OpenAIConfig, OpenAIServer
    from kiln.serve.server import free_port

    _, _, repo = tiny_build
    cfg = OpenAIConfig(triton_url=tiny_server.urls()["grpc"], repo=repo, port=free_port())
    with OpenAIServer(cfg):
        yield f"{cfg.url}/v1", tiny_build[0].recipe.name
