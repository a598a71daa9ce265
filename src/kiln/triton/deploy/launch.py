"""The serving command and ``launch.sh``: one ``tritonserver``, or TensorRT-LLM's leader mode (``mpirun``, one
server per rank), as kiln's deploy files and ``kiln serve`` run it. See :mod:`kiln.triton.deploy`."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence


from kiln.triton.deploy.info import (
    CONTAINER_REPO,
    DeployInfo,
)


_REPO_MARK = "\x00KILN_MODEL_REPO\x00"  # stands for "${MODEL_REPO}" while argv lists are rendered to shell


#: The Triton flags upstream's launch script adds in orchestrator mode (spawned processes allocate their own
#: pools): TensorRT-LLM triton_backend/scripts/launch_triton_server.py, --multi-model.
ORCHESTRATOR_ENV = ("TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1")


def launch_command(info: DeployInfo, repo: str) -> list[list[str]]:
    """The ``tritonserver`` argv of every rank, rank 0 first (one list when ``world_size == 1``).

    Every rank: ``--model-repository``, the three ports, ``--disable-auto-complete-config`` (kiln writes
    complete configs). With more than one rank, each also gets its own Python-backend shared-memory prefix,
    and ranks above 0 load only :attr:`DeployInfo.tensorrt_llm_model_names` and open no endpoints. Join
    them with :func:`mpirun_command`; :func:`server_command` gives the argv for one host.
    """
    ranks: list[list[str]] = []
    if info.orchestrator_gpus:  # one process: the orchestrator spawns each model's ranks on its own GPUs
        argv = ["tritonserver", f"--model-repository={repo}", f"--http-port={info.http_port}",
                f"--grpc-port={info.grpc_port}", f"--metrics-port={info.metrics_port}",
                "--disable-auto-complete-config", "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false"]
        argv += [f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(info.orchestrator_gpus)]
        return [argv]
    for rank in range(1 if info.llmapi else info.world_size):  # llmapi: the LLM API starts its own ranks
        argv = [
            "tritonserver",
            f"--model-repository={repo}",
            f"--http-port={info.http_port}",
            f"--grpc-port={info.grpc_port}",
            f"--metrics-port={info.metrics_port}",
            "--disable-auto-complete-config",
        ]
        if not info.gpu:
            argv.append("--allow-gpu-metrics=false")  # reference target: no GPU to read metrics from
        if info.world_size > 1 and not info.llmapi:
            argv.append(f"--backend-config=python,shm-region-prefix-name=prefix{rank}_")
        if rank > 0:
            argv.append("--model-control-mode=explicit")
            argv += [f"--load-model={name}" for name in info.tensorrt_llm_model_names]
            argv += ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
        ranks.append(argv)
    return ranks


def mpirun_command(info: DeployInfo, repo: str, *, mpirun_args: Sequence[str] = ()) -> list[str]:
    """``mpirun --allow-run-as-root [mpirun_args] -n 1 <rank 0> : -n 1 <rank 1> : ...`` (leader mode)."""
    argv = ["mpirun", "--allow-run-as-root", *mpirun_args]
    for rank, rank_argv in enumerate(launch_command(info, repo)):
        if rank:
            argv.append(":")
        argv += ["-n", "1", *rank_argv]
    return argv


def server_command(info: DeployInfo, repo: str) -> list[str]:
    """The argv that starts the server on one host: ``tritonserver ...`` for one rank, else ``mpirun ...``."""
    if info.orchestrator_gpus:
        return ["env", *ORCHESTRATOR_ENV, *launch_command(info, repo)[0]]
    if info.world_size == 1 or info.llmapi:
        return launch_command(info, repo)[0]
    return mpirun_command(info, repo)


def _sh(word: str) -> str:
    """Quote one argv word for bash; the repository marker becomes a quoted ``${MODEL_REPO}``."""
    if _REPO_MARK not in word:
        return shlex.quote(word)
    escaped = re.sub(r'([\\"$`])', r"\\\1", word)
    return '"' + escaped.replace(_REPO_MARK, "${MODEL_REPO}") + '"'


def render_launch_script(info: DeployInfo) -> str:
    """The text of ``launch.sh`` (see the module docstring)."""
    lines = [
        "#!/usr/bin/env bash",
        f"# Start Triton Inference Server for kiln recipe {info.recipe_name!r}: {info.world_size} rank(s).",
        "# Written by kiln; change the recipe and package again rather than editing this file.",
    ]
    if not info.gpu:
        lines.append("# target: reference -- the CPU test and development vehicle, not a fast path; no GPU is used.")
    lines += [
        "#",
        "# Environment:",
        f"#   MODEL_REPO         the model repository (default {CONTAINER_REPO}, where docker-compose.yml and the",
        "#                      Kubernetes manifests mount it; set it to run on a host with tritonserver installed)",
    ]
    if info.world_size > 1 and not info.llmapi:
        lines += [
            "#   KILN_MPI_HOSTFILE  spread the ranks over several nodes: an Open MPI hostfile, this node first,",
            "#                      `<host> slots=<GPUs>` per line (k8s leader.sh writes it). Remote ranks start",
            "#                      over ssh (OMPI_MCA_plm_rsh_args); empty: every rank on this host.",
        ]
    lines += [
        "set -euo pipefail",
        "",
        f'MODEL_REPO="${{MODEL_REPO:-{CONTAINER_REPO}}}"',
        'if [[ ! -d "${MODEL_REPO}" ]]; then',
        '  echo "launch.sh: model repository ${MODEL_REPO} is not a directory; set MODEL_REPO" >&2',
        "  exit 2",
        "fi",
    ]
    if info.llmapi:
        lines += ["", "# Triton's llmapi model: TensorRT-LLM's PyTorch backend loads the unified checkpoint named in",
                  "# tensorrt_llm/1/model.yaml (relative to that directory) and starts its tp × pp ranks itself."]
    if info.gpu and not info.llmapi:
        lines += [
            "",
            "# The engine only loads with the TensorRT-LLM and TensorRT that built it (kiln.json records them):",
            "# refuse a mismatch now, with the command that rebuilds it for this container.",
            'python3 "${MODEL_REPO}/kiln_check_engine.py" "${MODEL_REPO}"',
            "",
            f"# The tensorrt_llm configs name their engines under {CONTAINER_REPO} (where compose and Kubernetes mount",
            "# the repository). Elsewhere, serve a shadow repository: the same models, linked, with those paths",
            "# pointing into MODEL_REPO.",
            f'if [[ "$(cd "${{MODEL_REPO}}" && pwd -P)" != "{CONTAINER_REPO}" ]]; then',
            '  shadow="$(mktemp -d "${TMPDIR:-/tmp}/kiln-repo.XXXXXX")"',
            "  python3 - \"${MODEL_REPO}\" \"${shadow}\" <<'PY'",
            "import os, sys",
            "src, dst = os.path.abspath(sys.argv[1]), sys.argv[2]",
            "for name in sorted(os.listdir(src)):",
            "    model = os.path.join(src, name)",
            "    if not os.path.isfile(os.path.join(model, 'config.pbtxt')):",
            "        continue",
            "    os.makedirs(os.path.join(dst, name))",
            "    for entry in os.listdir(model):",
            "        if entry != 'config.pbtxt':",
            "            os.symlink(os.path.join(model, entry), os.path.join(dst, name, entry))",
            "    with open(os.path.join(model, 'config.pbtxt')) as fh:",
            "        text = fh.read()",
            f"    text = text.replace('\"{CONTAINER_REPO}/' + name + '/1/engine\"', '\"' + os.path.join(model, '1', 'engine') + '\"')",
            "    with open(os.path.join(dst, name, 'config.pbtxt'), 'w') as fh:",
            "        fh.write(text)",
            "PY",
            '  MODEL_REPO="${shadow}"',
            "fi",
        ]
    lines.append("")
    ranks = launch_command(info, _REPO_MARK)
    if info.orchestrator_gpus:
        lines += ["# Draft+target with tp × pp > 1: TensorRT-LLM's orchestrator mode (upstream's --multi-model): one",
                  "# server process spawns each model's ranks on the GPUs its gpu_device_ids names."]
        lines += [f"export {kv}" for kv in ORCHESTRATOR_ENV]
        lines.append("exec " + " ".join(_sh(w) for w in ranks[0]))
        return "\n".join(lines) + "\n"
    if info.world_size == 1 or info.llmapi:
        lines.append("exec " + " ".join(_sh(w) for w in ranks[0]))
        return "\n".join(lines) + "\n"
    lines += [
        "mpi_args=(--allow-run-as-root)",
        'if [[ -n "${KILN_MPI_HOSTFILE:-}" ]]; then',
        "  # --prefix lets the remote side find Open MPI's daemon; -x forwards what the ranks need.",
        '  mpi_prefix="$(dirname "$(dirname "$(command -v mpirun)")")"',
        '  mpi_args+=(--hostfile "${KILN_MPI_HOSTFILE}" --prefix "${mpi_prefix}" -x PATH -x LD_LIBRARY_PATH -x HOME)',
        "fi",
        "",
        "# Rank 0 loads the whole repository and serves; ranks above 0 load only the TensorRT-LLM model(s).",
        'exec mpirun "${mpi_args[@]}" \\',
    ]
    for rank, argv in enumerate(ranks):
        prefix = "  " if rank == 0 else "  : "
        tail = " \\" if rank < len(ranks) - 1 else ""
        lines.append(prefix + "-n 1 " + " ".join(_sh(w) for w in argv) + tail)
    return "\n".join(lines) + "\n"
