"""`kiln lint` on NVIDIA's own repository: tensorrtllm_backend@c2e65b8 `all_models/inflight_batcher_llm` filled with
upstream's tools/fill_template.py exactly as its README says (tests/fixtures/upstream_repository_filled, config.pbtxt
files only; the fill commands are in its README.md). Unfilled parameters are graded by how upstream's models read them
(src/kiln/triton/data/upstream_parameters.yaml); absolute paths of the serving container are warnings here."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from click.testing import CliRunner

from kiln.cli.main import cli
from kiln.triton.lint import lint_repository, upstream_parameters

FIXTURE = Path(__file__).parent / "fixtures" / "upstream_repository_filled"
TOKENIZER = "/app/tensorrt_llm/examples/models/core/gpt/gpt2"  # the README's TOKENIZER_DIR


def _copy(tmp_path: Path) -> Path:
    repo = tmp_path / "triton_model_repo"
    shutil.copytree(FIXTURE, repo, ignore=shutil.ignore_patterns("README.md"))
    return repo


def test_the_readme_filled_repository_lints_with_no_errors(tmp_path):
    repo = _copy(tmp_path)
    found = lint_repository(repo)
    assert [f.format() for f in found if f.severity == "error"] == []
    unfilled = [f for f in found if f.message.startswith("unfilled parameter")]
    # 50 parameters left as ${…} (a 51st sits in a comment, which tritonserver never reads): each a warning with
    # the default upstream falls back to and the upstream file:line that says so
    assert len(unfilled) == 50
    assert all(re.search(r"default: .+ \[tensorrtllm_backend@c2e65b8 \S+:\d+\]", f.message) for f in unfilled)
    paths = [f.format() for f in found if "does not exist on this machine" in f.message]
    assert len(paths) == 3  # the README's tokenizer twice and its engine directory: the container's paths
    assert sum(TOKENIZER in p for p in paths) == 2 and sum("/engines/gpt/fp16/4-gpu" in p for p in paths) == 1
    result = CliRunner().invoke(cli, ["lint", str(repo)])
    assert result.exit_code == 0, result.output


def test_an_unfilled_tokenizer_dir_is_one_error_per_model_that_reads_it(tmp_path):
    repo = _copy(tmp_path)
    for model in ("preprocessing", "postprocessing"):
        cfg = repo / model / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace(f'"{TOKENIZER}"', '"${tokenizer_dir}"'))
    errors = [f for f in lint_repository(repo) if f.severity == "error"]
    assert sorted(f.model for f in errors) == ["postprocessing", "preprocessing"], [f.format() for f in errors]
    assert all("AutoTokenizer.from_pretrained" in f.message and f.line for f in errors)
    # the C++ backend recognises its own ${tokenizer_dir} and ignores it: a warning there, not an error
    trt = [f for f in lint_repository(repo) if f.model == "tensorrt_llm" and "${tokenizer_dir}" in f.message]
    assert len(trt) == 1 and trt[0].severity == "warning"
    assert CliRunner().invoke(cli, ["lint", str(repo)]).exit_code == 1


def test_conditional_and_repository_paths_are_errors(tmp_path):
    """lookahead parameters are read with no fallback once decoding_mode is lookahead; a missing path inside the
    repository is an error (only absolute paths elsewhere are the container's)."""
    repo = _copy(tmp_path)
    cfg = repo / "tensorrt_llm" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('"${decoding_mode}"', '"lookahead"'))
    pre = repo / "preprocessing" / "config.pbtxt"
    pre.write_text(pre.read_text().replace(f'"{TOKENIZER}"', f'"{repo}/preprocessing/1/tokenizer"'))
    errors = [f.format() for f in lint_repository(repo) if f.severity == "error"]
    assert sum("lookahead" in e and "TLLM_THROW" in e for e in errors) == 3
    assert sum("[preprocessing] tokenizer directory" in e and "does not exist" in e for e in errors) == 1
    assert len(errors) == 4, errors


def test_the_grading_table_names_its_source_and_every_entry_a_line():
    table = upstream_parameters()
    assert table["source"] == {"repo": "triton-inference-server/tensorrtllm_backend", "commit": "c2e65b8"}
    for model, params in table["models"].items():
        for key, entry in params.items():
            assert re.fullmatch(r"\S+\.(cc|py):\d+", entry["source"]), (model, key)
            assert ("reason" in entry) if entry.get("severity") == "error" or "error_when" in entry else True
            assert "default" in entry or entry.get("severity") == "error", (model, key)
    # every parameter the fixture leaves unfilled is in the table
    for cfg in FIXTURE.glob("*/config.pbtxt"):
        for key in re.findall(r'key: "(\w+)"\s*\n\s*value: \{\s*\n\s*string_value: "\$\{', cfg.read_text()):
            assert key in table["models"][cfg.parent.name], (cfg.parent.name, key)
