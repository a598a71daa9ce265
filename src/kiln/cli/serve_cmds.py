"""Serving commands: serve, stop, infer, bench (registered on the main group)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from kiln.cli.commands import layout_options
from kiln.cli.main import cli, err, handle_errors, load, out, set_option
from kiln.recipe.schema import ServingSection
from kiln.util.errors import InputError

DEFAULTS = ServingSection()  # the schema is the only home of defaults


def _is_repo(path: Path) -> bool:
    return path.is_dir() and ((path / "kiln.json").is_file() or any(path.glob("*/config.pbtxt")))


def _prepare(target: str, overrides, build_dir: Path, repo_dir: Path):
    """A repository path and the serving section that applies: a REPO as is, or a RECIPE built first."""
    p = Path(target)
    if _is_repo(p):
        if overrides:
            raise InputError("--set applies to recipes; a repository is served as it was packaged")
        from kiln.serve.session import serving_record

        return p, serving_record(p), None  # where kiln.json records it is served (the recipe's serving.*)
    from kiln.pipeline.runner import Layout, render_summary, run

    loaded = load(target, overrides)
    summary = run(loaded, Layout(build_dir, repo_dir), to_step="package", console=err)  # serving needs no task gate
    if summary.failure is not None:
        render_summary(summary, err)
        raise summary.failure
    if loaded.recipe.target == "reference":
        err.print("note: target 'reference' serves the quantized model with PyTorch on CPU — a test and "
                  "development vehicle, not the fast path.", style="dim")
    if loaded.recipe.target == "pytorch":
        from kiln.recipe.schema import llmapi_runtime

        if llmapi_runtime(loaded.recipe) == "reference":
            err.print("note: target 'pytorch' without a GPU here: kiln's CPU reference runtime serves the llmapi "
                      "model — a test and development vehicle, not the fast path.", style="dim")
    return repo_dir / loaded.recipe.name, loaded.recipe.serving, loaded


@cli.command()
@click.argument("target")
@set_option
@click.option("--host", help=f"Address to bind (default: the recipe's serving.host, {DEFAULTS.host}).")
@click.option("--http-port", type=int, help="HTTP port (default: serving.http_port).")
@click.option("--grpc-port", type=int, help="gRPC port (default: serving.grpc_port).")
@click.option("--metrics-port", type=int, help="Metrics port (default: serving.metrics_port).")
@click.option("--docker", is_flag=True, help="Run the NGC serving container named in the repository's kiln.json "
              "(with docker, or podman where docker is absent).")
@click.option("--background", is_flag=True, help="Detach once ready; stop it with `kiln stop`.")
@click.option("--openai", "openai", is_flag=True,
              help="Also serve kiln's OpenAI-compatible API (/v1/completions, /v1/chat/completions) in front of Triton.")
@click.option("--openai-port", type=int, help="Its port (default: serving.openai_port).")
@click.option("--timeout", type=float, default=300, show_default=True, help="Seconds to wait for readiness.")
@click.option("--state-file", type=click.Path(path_type=Path), hidden=True)
@click.option("--stack", type=click.Choice(["triton", "dynamo"]), default="triton", show_default=True,
              help="dynamo (target pytorch): NVIDIA Dynamo's real frontend (OpenAI API on the HTTP port) in front of "
                   "kiln's CPU worker, a test and development vehicle (on a GPU: deploy/<recipe>/dynamo/).")
@click.option("--workers", type=click.IntRange(1, 8), default=1, show_default=True,
              help="--stack dynamo: kiln CPU workers behind the frontend.")
@layout_options
@handle_errors
def serve(target, overrides, host, http_port, grpc_port, metrics_port, docker, background, openai, openai_port,
          timeout, state_file, stack, workers, build_dir, repo_dir):
    """Serve TARGET (a recipe, built first if needed, or a packaged repository: on the host and ports its kiln.json
    records) with a real tritonserver (or, with --stack dynamo, Dynamo's frontend)."""
    if stack == "dynamo":
        repo, serving, _ = _prepare(target, overrides, build_dir, repo_dir)
        _serve_dynamo(repo, serving, http_port, workers, background, timeout, state_file)
        return
    from kiln.serve.openai import OpenAIConfig
    from kiln.serve.server import ServerConfig
    from kiln.serve.session import (check_engine_here, docker_command, run_docker, serve_foreground,
                                    serving_engine, start_background, state_file_for)

    repo, serving, loaded = _prepare(target, overrides, build_dir, repo_dir)
    cfg = ServerConfig(repo=repo, host=host or serving.host, http_port=http_port or serving.http_port,
                       grpc_port=grpc_port or serving.grpc_port, metrics_port=metrics_port or serving.metrics_port)
    info = json.loads((repo / "kiln.json").read_text()) if (repo / "kiln.json").is_file() else {}
    front = None
    if openai:
        from kiln.serve.openai.app import front_refusal

        refused = front_refusal(repo, info)
        if refused:
            raise InputError(refused)
        front = OpenAIConfig(triton_url="", triton_model=serving.openai_model, repo=repo, host=cfg.host,
                             port=openai_port or serving.openai_port)
    if docker:
        if openai:
            raise InputError("--openai runs beside a local server; with --docker, run `kiln openai --triton-url "
                             "HOST:GRPC_PORT --repo REPO` next to the container")
        engine, _ = serving_engine()
        cmd = docker_command(repo, info, cfg, engine=engine)
        err.print("$ " + " ".join(cmd), markup=False)
        sys.exit(run_docker(cmd))
    if info.get("layout") == "llmapi" and info.get("llmapi_runtime") == "tensorrt_llm":
        import importlib.util

        if importlib.util.find_spec("tensorrt_llm") is None:  # looked up, never imported
            raise InputError(f"{repo} runs TensorRT-LLM's LLM API (target pytorch) and this environment has no "
                             "tensorrt_llm: serve it with --docker (the NGC image in kiln.json), or "
                             "deploy/<recipe>/launch.sh on a GPU host; to try it on this machine, package the recipe "
                             "with --set serving.llmapi_runtime=reference (kiln's CPU test and development vehicle)")
    check_engine_here(repo, info)
    if background:
        sf = state_file_for(repo)
        argv = [sys.executable, "-m", "kiln", "serve", str(repo), "--host", cfg.host,
                "--http-port", str(cfg.http_port), "--grpc-port", str(cfg.grpc_port),
                "--metrics-port", str(cfg.metrics_port), "--timeout", str(timeout), "--state-file", str(sf)]
        if front is not None:
            argv += ["--openai", "--openai-port", str(front.port)]
        state = start_background(argv, sf, sf.with_suffix(".log"), timeout)
        _announce(state, background=True)
        return

    def announce(state: dict) -> None:
        _announce(state, background=False)

    if state_file is None and not state_file_for(repo).exists():  # so kiln infer/bench find it (serving_urls)
        state_file = state_file_for(repo)
    sys.exit(serve_foreground(cfg, announce, state_file, timeout, openai=front))


def _serve_dynamo(repo: Path, serving, http_port, workers, background, timeout, state_file) -> None:
    from kiln.serve.dynamo import dynamo_available, serve_foreground, stack_for_repository
    from kiln.serve.session import start_background, state_file_for

    why = dynamo_available()
    if why:
        raise InputError(why)
    port = http_port or serving.http_port  # kiln.json's serving record for a repository, else the recipe's
    err.print("note: --stack dynamo runs NVIDIA Dynamo's real frontend in front of kiln's CPU reference runtime (a "
              "test and development vehicle, not the fast path); on a GPU use deploy/<recipe>/dynamo/.", style="dim")
    if background:
        sf = state_file_for(repo)
        argv = [sys.executable, "-m", "kiln", "serve", str(repo), "--stack", "dynamo", "--http-port", str(port),
                "--workers", str(workers), "--timeout", str(timeout), "--state-file", str(sf)]
        _announce_dynamo(start_background(argv, sf, sf.with_suffix(".log"), timeout), background=True)
        return
    try:
        logs = (state_file or state_file_for(repo)).parent.resolve() / f"{repo.resolve().name}-dynamo-logs"
        stack = stack_for_repository(repo, port, workers, log_dir=logs)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    stack.startup_timeout_s = timeout
    sys.exit(serve_foreground(stack, repo, lambda state: _announce_dynamo(state, background=False), state_file))


def _announce_dynamo(state: dict, background: bool) -> None:
    urls = state["urls"]
    out.print(f"ready: {state['repo']} on Dynamo (started in {state.get('startup_s') or 0:.1f}s)", markup=False)
    out.print(f"  openai  {urls['openai']}   (POST {urls['openai']}/chat/completions, /completions; GET /models)",
              markup=False)
    out.print(f"  logs    {state['log']}", markup=False)
    out.print("stop with: kiln stop" if background else "Ctrl-C to stop", markup=False)
    sys.stdout.flush()


def _announce(state: dict, background: bool) -> None:
    urls = state["urls"]
    out.print(f"ready: {state['repo']}  (started in {state.get('startup_s') or 0:.1f}s)", markup=False)
    llmapi = (Path(state["repo"]) / "tensorrt_llm" / "1" / "model.yaml").is_file()  # target pytorch's layout
    model = "tensorrt_llm" if llmapi else "ensemble"
    out.print(f"  http    {urls['http']}   (POST {urls['http']}/v2/models/{model}/generate)", markup=False)
    out.print(f"  grpc    {urls['grpc']}", markup=False)
    out.print(f"  metrics {urls['metrics']}", markup=False)
    if "openai" in urls:
        out.print(f"  openai  {urls['openai']}   (POST {urls['openai']}/chat/completions, /completions)", markup=False)
    out.print("stop with: kiln stop" if background else "Ctrl-C to stop", markup=False)
    sys.stdout.flush()


@cli.command("openai")
@click.option("--triton-url", default=f"127.0.0.1:{DEFAULTS.grpc_port}", show_default=True,
              help="Triton's gRPC endpoint, host:port.")
@click.option("--repo", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="The packaged repository: the served name (its recipe), chat template and tokenizer.")
@click.option("--triton-model", default=DEFAULTS.openai_model, show_default=True,
              help="The Triton model called (ensemble contract: text_input, max_tokens -> text_output).")
@click.option("--model-name", help="The id clients send as `model` (default: the recipe's name, else the Triton model).")
@click.option("--host", default=DEFAULTS.host, show_default=True, help="Address to bind (0.0.0.0 in a container).")
@click.option("--port", type=int, default=DEFAULTS.openai_port, show_default=True)
@handle_errors
def openai_cmd(triton_url, repo, triton_model, model_name, host, port):
    """Serve kiln's OpenAI-compatible API in front of a running Triton server (the deploy files' sidecar)."""
    from kiln.serve.openai import OpenAIConfig, OpenAIServer

    cfg = OpenAIConfig(triton_url=triton_url, triton_model=triton_model, repo=repo, model_name=model_name,
                       host=host, port=port)
    server = OpenAIServer(cfg)
    out.print(f"OpenAI-compatible API on {cfg.url}/v1 → Triton {triton_model} at {triton_url} (Ctrl-C to stop)",
              markup=False)
    sys.stdout.flush()
    server.run()


@cli.command()
@click.argument("repo", required=False, type=click.Path(path_type=Path))
@handle_errors
def stop(repo: Optional[Path]) -> None:
    """Stop background servers started with `kiln serve --background` (all, or the one for REPO)."""
    from kiln.serve.session import running, state_file_for, stop_background

    files = [state_file_for(repo)] if repo else [f for f, _ in running()]
    stopped = [f for f in files if stop_background(f)]
    out.print(f"stopped {len(stopped)} server(s)" if stopped else "no kiln server was running", markup=False)


def _sampling(temperature, top_k, top_p, seed) -> dict:
    values = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    return {k: v for k, v in values.items() if v is not None}


def _served(serving: Optional[Path]) -> dict:
    """The running kiln serve's URLs (``--serving REPO``'s, or the only one running), else the default ports."""
    from kiln.serve.session import serving_urls

    return serving_urls(serving) or {"grpc": f"127.0.0.1:{DEFAULTS.grpc_port}",
                                     "http": f"http://127.0.0.1:{DEFAULTS.http_port}"}


def _served_tokenizer(serving: Optional[Path]) -> Optional[str]:
    """The served repository's tokenizer folder (``--serving REPO``'s, or the one running kiln serve's), if any:
    kiln bench's --input-len then counts its tokens."""
    from kiln.serve.session import running

    repos = [Path(serving)] if serving else [Path(st["repo"]) for _, st in running() if st.get("repo")]
    folder = repos[0] / "preprocessing" / "1" / "tokenizer" if len(repos) == 1 else None
    return str(folder) if folder is not None and (folder / "tokenizer.json").is_file() else None


serving_option = click.option(
    "--serving", type=click.Path(path_type=Path),
    help="The packaged repository a running `kiln serve` serves: use its ports (default: the one running kiln "
         f"serve, else 127.0.0.1 with the default ports {DEFAULTS.grpc_port}/{DEFAULTS.http_port}).")


@cli.command()
@click.argument("prompt")
@click.option("--url", help="gRPC host:port (default: the running kiln serve's, see --serving).")
@click.option("--http-url", help="HTTP URL, used with --no-stream (default: the running kiln serve's).")
@serving_option
@click.option("--model", default="ensemble", show_default=True, type=click.Choice(["ensemble", "tensorrt_llm_bls"]))
@click.option("--max-tokens", type=click.IntRange(1), default=64, show_default=True)
@click.option("--temperature", type=float, help="Sampling temperature (0 or unset: greedy).")
@click.option("--top-k", type=int)
@click.option("--top-p", type=float)
@click.option("--seed", type=int)
@click.option("--no-stream", is_flag=True, help="One response through the HTTP generate endpoint.")
@handle_errors
def infer(prompt, url, http_url, serving, model, max_tokens, temperature, top_k, top_p, seed, no_stream):
    """Send PROMPT through the ensemble (or BLS) and print the completion as it streams."""
    from kiln.serve.client import generate_http, generate_stream

    if not url or not http_url:
        urls = _served(serving)
        url, http_url = url or urls["grpc"], http_url or urls["http"]
    from tritonclient.utils import InferenceServerException

    from kiln.util.errors import KilnError

    sampling = _sampling(temperature, top_k, top_p, seed)
    try:
        if no_stream:
            click.echo(generate_http(http_url, prompt, max_tokens, model=model, **sampling))
            return
        for piece in generate_stream(url, prompt, max_tokens, model=model, **sampling):
            click.echo(piece, nl=False)
            sys.stdout.flush()
    except InferenceServerException as exc:
        raise KilnError(f"Triton at {http_url if no_stream else url}: {exc}") from None
    click.echo()


def _levels(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter("comma-separated integers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise click.BadParameter("at least one level, each ≥ 1")
    return values


@cli.command()
@click.option("--url", help="gRPC host:port (default: the running kiln serve's, see --serving).")
@serving_option
@click.option("--openai", "openai_url", metavar="URL", is_flag=False, flag_value="",
              help="Load an OpenAI-compatible server instead (kiln's, vLLM, trtllm-serve, ...): its base URL, e.g. "
                   "http://127.0.0.1:9000/v1; without a URL, the running `kiln serve --openai`'s. Same levels, same "
                   "report.")
@click.option("--model", default="ensemble", show_default=True,
              help="The Triton model (ensemble or tensorrt_llm_bls); with --openai the model id (default: the "
                   "server's first).")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Fixed concurrency levels.")
@click.option("--rate", type=float, help="Open-loop request rate (req/s) instead of fixed concurrency.")
@click.option("--poisson", is_flag=True, help="With --rate: Poisson arrivals.")
@click.option("--duration", type=float, default=20.0, show_default=True, help="Seconds per level.")
@click.option("--input-len", type=int, default=64, show_default=True,
              help="Synthetic prompt length: tokens of the served model's tokenizer when bench finds the running kiln "
                   "serve (or --serving REPO), else words.")
@click.option("--output-len", type=int, default=32, show_default=True, help="max_tokens per request.")
@click.option("--prompts", type=click.Path(path_type=Path, exists=True), help="Prompts file (one per line / jsonl).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("build/bench"), show_default=True,
              help="Where bench.json / bench.csv / bench.png go.")
@click.option("--recipe", help="Compare each level with `kiln plan`'s speed prediction for this recipe (the same "
              "model: isl = --input-len, osl = --output-len, the level's concurrency) …")
@click.option("--gpu", help="… on this GPU (default: the recipe's hardware.gpu).")
@handle_errors
def bench(url, serving, openai_url, model, concurrency, rate, poisson, duration, input_len, output_len, prompts,
          out_dir, recipe, gpu):
    """Load a running server (Triton gRPC streaming, or --openai an OpenAI-compatible one) and report TTFT, ITL,
    latency percentiles and throughput."""
    from kiln.serve.bench import BenchConfig, compare_with_plan, format_comparison, format_report, load_prompts, run_bench

    prompt_set = load_prompts(prompts) if prompts else None
    from_record = bool(serving) or openai_url == "" or (not url and openai_url is None)
    if openai_url == "":
        urls = _served(serving)
        if "openai" not in urls:
            raise InputError("--openai without a URL: the running kiln serve has no OpenAI server (start it with "
                             "--openai) or none is running; pass the URL, e.g. --openai http://127.0.0.1:9000/v1")
        openai_url = urls["openai"]
    elif not url and openai_url is None:
        url = _served(serving)["grpc"]
    tokenizer_dir = _served_tokenizer(serving) if from_record else None
    if openai_url is None and model not in ("ensemble", "tensorrt_llm_bls"):
        raise InputError(f"--model {model!r}: a Triton bench calls ensemble or tensorrt_llm_bls")
    cfg = BenchConfig(url=openai_url or url, model=model, api="openai" if openai_url else "triton",
                      concurrency=_levels(concurrency), rate=rate, poisson=poisson,
                      duration_s=duration, input_len=input_len, output_len=output_len,
                      prompts=tuple(prompt_set.prompts) if prompt_set else None, tokenizer_dir=tokenizer_dir,
                      expected=prompt_set.expected if prompt_set else None)
    report = run_bench(cfg)
    paths = report.write(out_dir)
    out.print(format_report(report), markup=False)
    if recipe:
        from kiln.plan import PlanError, plan_for

        try:
            plan = plan_for(load(recipe, ()), gpu)
        except PlanError as exc:
            raise InputError(f"--recipe: {exc}") from None
        out.print(format_comparison(compare_with_plan(report, plan)), markup=False)
    out.print("wrote " + ", ".join(str(p) for p in paths.values()), markup=False)
    if report.total_errors:
        err.print(f"error: {report.total_errors} request(s) failed or mismatched", style="red")
        sys.exit(1)
