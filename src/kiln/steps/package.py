"""Package: a complete, linted Triton model repository (`triton_repo/<recipe>/`) and deployment files
(`deploy/<recipe>/`) for the recipe. Target pytorch gets Triton's llmapi layout (kiln.triton.llmapi_repository)
and the trtllm-serve files beside its deploy files."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Optional, Protocol

from kiln.models.tiny import builtin_chat_template
from kiln.recipe.loader import LoadedRecipe, load_recipe
from kiln.recipe.schema import HF_PREFIX, Recipe
from kiln.steps.base import StepContext, StepResult, StepSpec
from kiln.steps.evaluate import EvaluateResult
from kiln.steps.resolve import ResolveResult
from kiln.steps.engine import ENGINE_SUBDIR, EngineResult
from kiln.steps.placement import Placement, place_draft_target
from kiln.triton.lint import lint_repository
from kiln.triton.repository import RepoInputs, standin_engine_config, write_repository
from kiln.util.artifacts import atomic_dir, read_manifest
from kiln.util.errors import InputError, KilnError

CHECKPOINT = "checkpoint"  # the quantize step's HF model + ModelOpt state + tokenizer


#: Beside the llmapi model's model.yaml: the built-in model's chat template (its tokenizer carries none).
CHAT_TEMPLATE = "chat_template.jinja"


def deploy_dir_for(repo_final: Path) -> Path:
    """deploy/<recipe>/ beside the repository root (triton_repo/<recipe> → deploy/<recipe>)."""
    return repo_final.parent.parent / "deploy" / repo_final.name


def _quantization(quantize_dir: Path) -> dict:
    cfg = quantize_dir / "trtllm_checkpoint" / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("quantization", {}) or {}
    return {}


def _engine_dir(recipe: Recipe, build_dir: Path, quantize_dir: Path, max_seq_len: int, scratch: Path,
                name: str) -> Path:
    if recipe.target == "tensorrt":
        return build_dir / ENGINE_SUBDIR
    d = scratch / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(standin_engine_config(recipe, max_seq_len, _quantization(quantize_dir)),
                                              indent=2))
    return d


def _draft_loaded(ctx: StepContext) -> Optional[LoadedRecipe]:
    return _draft_of(ctx.loaded)


def _draft_of(loaded: LoadedRecipe) -> Optional[LoadedRecipe]:
    r = loaded.recipe
    ref = r.engine.speculative.draft_recipe
    if r.engine.speculative.mode != "draft_tokens_external" or not ref:
        return None
    base = loaded.path.parent if loaded.path else Path(".")
    return load_recipe(base / ref)


def _draft_inputs(ctx: StepContext, draft_loaded: LoadedRecipe, scratch: Path, max_seq_len: int,
                  placement: Optional[Placement]) -> RepoInputs:
    draft = draft_loaded.recipe
    build_root = ctx.inputs["engine"].parent.parent
    q, b = build_root / draft.name / "quantize", build_root / draft.name / "engine"
    if not (q / "manifest.json").is_file() or not (b / "manifest.json").is_file():
        raise InputError(f"the draft model {draft.name} is not built: run `kiln build {draft_loaded.path}` first")
    return RepoInputs(draft, q / CHECKPOINT, _engine_dir(draft, b, q, max_seq_len, scratch, "draft-engine"),
                      q / CHECKPOINT, kv_tokens=placement.kv_tokens if placement else None,
                      gpu_device_ids=placement.draft_devices if placement else None)


class PackageResult(StepResult):
    """The repository written: how many models, the serving container (tensorrt target) and the deploy files."""

    models: int
    container: str
    deploy: str


def package(ctx: StepContext) -> PackageResult:
    r = ctx.recipe
    quantize_dir, build_dir = ctx.inputs["quantize"], ctx.inputs["engine"]
    max_seq_len = int(ctx.result(ResolveResult).max_seq_len or r.engine.max_seq_len or r.engine.max_input_len)
    if r.target == "pytorch":
        return _package_llmapi(ctx, quantize_dir, max_seq_len)
    engine = ctx.result(EngineResult)
    versions = {k: v for k, v in (("tensorrt_llm", engine.tensorrt_llm), ("tensorrt", engine.tensorrt)) if v}
    quality = ctx.result(EvaluateResult)
    draft_loaded = _draft_loaded(ctx)
    placement = place_draft_target(ctx.loaded, draft_loaded) if draft_loaded and r.target == "tensorrt" else None
    if placement is not None:
        ctx.log(f"  draft+target: {placement.note}" + (" (orchestrator mode)" if placement.orchestrator else ""))
    with tempfile.TemporaryDirectory(prefix="kiln-package-") as scratch_name:
        scratch = Path(scratch_name)
        inputs = RepoInputs(
            recipe=r, tokenizer_dir=quantize_dir / CHECKPOINT,
            engine_dir=_engine_dir(r, build_dir, quantize_dir, max_seq_len, scratch, "engine"),
            checkpoint_dir=quantize_dir / CHECKPOINT, fingerprint=ctx.fingerprint,
            versions=versions,
            draft=_draft_inputs(ctx, draft_loaded, scratch, max_seq_len, placement) if draft_loaded else None,
            quality=quality.figures() or None, image=engine.image, image_digest=engine.image_digest,
            kv_tokens=placement.kv_tokens if placement else None,
            gpu_device_ids=placement.target_devices if placement else None,
            orchestrator=bool(placement and placement.orchestrator),
            chat_template=builtin_chat_template(r.model.source))
        with ctx.status("writing the Triton repository"):
            info = write_repository(inputs, ctx.out_dir, max_seq_len, final=ctx.final_dir)
    _keep_empty_dirs(ctx.out_dir)
    findings = lint_repository(ctx.out_dir)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise KilnError("the packaged repository fails kiln lint:\n  " + "\n  ".join(f.format() for f in errors))
    deploy_files = deploy_dir_for(ctx.final_dir) if r.target == "tensorrt" and ctx.final_dir is not None else None
    return PackageResult(summary=f"{len(info['models'])} models, lint clean"
                         + (f", container {info['container']}" if info["container"] else ", reference runtime (CPU)"),
                         models=len(info["models"]), container=info["container"] or "",
                         deploy=str(deploy_files) if deploy_files else "")


def write_deploy(loaded: LoadedRecipe, repo: Path, source: Optional[EntrySourceLike] = None) -> Optional[Path]:
    """The package step's ``finish``: deployment files for the packaged repository ``repo`` (the tensorrt target,
    and target pytorch on TensorRT-LLM; the reference runtime is served locally by `kiln serve`), rendered again
    after every build or pull. With ``source`` (the remote-cache entry holding ``repo``) the pods' init step pulls
    it by digest; without, they mount a volume the user fills. Pods are sized from the plan."""
    from kiln.recipe.schema import llmapi_runtime
    from kiln.triton.deploy import DeployInfo, validate_manifests, write_deploy_files
    from kiln.triton.deploy.dynamo import DynamoDeploy, dynamo_image, image_stacks, write_dynamo_files
    from kiln.triton.deploy.info import sizing_for

    r = loaded.recipe
    llmapi = r.target == "pytorch"
    if not (r.target == "tensorrt" or (llmapi and llmapi_runtime(r) == "tensorrt_llm")):
        return None
    info = json.loads((repo / "kiln.json").read_text(encoding="utf-8"))
    manifest = read_manifest(repo) or {}
    repo_bytes = sum(int(v) for v in (manifest.get("files") or {}).values())
    hub = "hf-token" if r.model.source.startswith(HF_PREFIX) else None
    extra: dict = {}
    if not llmapi:
        draft_loaded = _draft_of(loaded)
        placement = place_draft_target(loaded, draft_loaded) if draft_loaded else None
        extra = {"draft_model_name": "tensorrt_llm_draft" if "tensorrt_llm_draft" in info["models"] else None,
                 "orchestrator": bool(placement and placement.orchestrator), "orchestrator_gpus": _gpus_used(placement)}
    deploy = DeployInfo.from_recipe(r, info["container"], hub_token_secret=hub, **extra,
                                    repo_pull=_repo_pull(loaded, info, source),
                                    sizing=sizing_for(r, repo_bytes=repo_bytes))
    final = deploy_dir_for(repo)
    with atomic_dir(final) as tmp:
        # target pytorch: only the stacks the image carries (no Triton image ships TensorRT-LLM after 1.2.1:
        # trtllm-serve and Dynamo files only); an image the table does not know gets the Triton files as before
        stacks = image_stacks(info["container"]) if llmapi else ()
        if not stacks or "triton-llmapi" in stacks:
            written = write_deploy_files(deploy, tmp, model_repo=repo)
            problems = validate_manifests([p for p in written if p.suffix in (".yaml", ".yml") and "k8s" in p.parts])
            if problems:
                raise KilnError("generated Kubernetes manifests do not validate:\n  " + "\n  ".join(problems))
        if llmapi:
            from kiln.triton.llmapi_repository import write_trtllm_serve_files

            write_trtllm_serve_files(r, info, tmp)
            image = dynamo_image(r)
            dynamo = DynamoDeploy.from_recipe(r, image, hub, repo_pull=_repo_pull(loaded, info, source, image),
                                              sizing=deploy.sizing)
            try:
                write_dynamo_files(dynamo, info["llm_args"], tmp)
            except ValueError as err:
                raise KilnError(str(err)) from None
    return final


class EntrySourceLike(Protocol):
    cache: str
    tag: str
    digest: str


def _repo_pull(loaded: LoadedRecipe, info: dict, source: Optional[EntrySourceLike], dynamo_image: str = ""):
    """How the pods fetch the repository: by digest from the remote cache, its recorded versions expected to be the
    serving image's (kiln's container table); the init image pinned by the user or kiln's own (a warning).
    ``dynamo_image``: for the Dynamo files, whose image loads the unified checkpoint with its own TensorRT-LLM (the
    LLM arguments must be that version's when the table pins the recipe's version to it)."""
    if source is None:
        return None
    from kiln import __version__
    from kiln.recipe.containers import row_for
    from kiln.triton.deploy.info import RepoPull

    s = loaded.recipe.serving
    image = info["container"]
    expect = [f"kiln.json:fingerprint={source.tag.partition('-')[2]}"]
    row = row_for(dynamo_image or image)
    if dynamo_image:
        if row is not None and row.tensorrt_llm == info.get("llm_args_version"):
            expect.append(f"kiln.json:llm_args_version={row.tensorrt_llm}")
    elif row is not None and loaded.recipe.target == "tensorrt":
        expect += [f"kiln.json:container={image}", f"kiln.json:engine.tensorrt_llm={row.tensorrt_llm}",
                   f"kiln.json:engine.tensorrt={row.tensorrt}"]
    elif row is not None:
        expect += [f"kiln.json:container={image}", f"kiln.json:serving_tensorrt_llm={row.tensorrt_llm}"]
    init_image = s.init_image or f"kiln-init:{__version__}"  # not pinned: recipe rule `init_image` warns
    return RepoPull(cache=source.cache, tag=source.tag, digest=source.digest, init_image=init_image,
                    registry_secret=s.registry_secret, cache_pvc=s.repo_cache_pvc, expect=tuple(expect))


def _eagle_head(r) -> Optional[Path]:
    """The EAGLE3 head (``engine.speculative.draft_model``) to link into the repository, so the server finds it in
    the container with the hub offline (Dynamo's files and the job containers set HF_HUB_OFFLINE=1): a local folder
    as it is, a hub head (``hf:org/name[@rev]``) downloaded here at its revision. The CPU reference runtime does not
    speculate, so a hub head is not downloaded for it (model.yaml names it by Hub id)."""
    from kiln.recipe.schema import llmapi_runtime

    sp = r.engine.speculative
    if sp.mode != "eagle" or not sp.draft_model:
        return None
    if sp.draft_model.startswith(HF_PREFIX) and llmapi_runtime(r) != "tensorrt_llm":
        return None
    from kiln.models import loading

    head = loading.resolve_model_dir(sp.draft_model, key="engine.speculative.draft_model", progress=False)
    if sp.draft_model.startswith(HF_PREFIX) and not any(head.glob("*.safetensors")):
        raise InputError(f"engine.speculative.draft_model: {sp.draft_model} has no safetensors weights, and kiln "
                         "downloads no pickled weights (pytorch_model.bin can run code when it is loaded): convert "
                         "the head to safetensors and set engine.speculative.draft_model to that folder")
    return head


def _package_llmapi(ctx: StepContext, quantize_dir: Path, max_seq_len: int) -> PackageResult:
    """Target pytorch: the llmapi repository, linted, and (for the GPU runtime) deploy and trtllm-serve files."""
    from kiln.recipe.schema import llmapi_runtime
    from kiln.steps.quantize import QuantizeResult
    from kiln.steps.runtime_jobs import UNIFIED_DIR
    from kiln.triton.llmapi_repository import write_llmapi_repository

    r = ctx.recipe
    draft_loaded = _draft_loaded(ctx)
    draft = None
    if draft_loaded is not None:
        d = draft_loaded.recipe
        draft = ctx.inputs["quantize"].parent.parent / d.name / "quantize" / UNIFIED_DIR
        if d.target != "pytorch" or not (draft / "config.json").is_file():
            raise InputError(f"engine.speculative.draft_recipe: the draft model {d.name} needs its unified checkpoint: "
                             f"build it with target: pytorch first (`kiln build {draft_loaded.path} --set "
                             "target=pytorch --to quantize`)")
    eagle_head = _eagle_head(r)
    produced = ctx.result(QuantizeResult).produced_by
    with ctx.status("writing the Triton llmapi repository"):
        quality = ctx.result(EvaluateResult).figures() or None
        info = write_llmapi_repository(r, quantize_dir / UNIFIED_DIR, ctx.out_dir, max_seq_len, final=ctx.final_dir,
                                       fingerprint=ctx.fingerprint, quality=quality,
                                       draft_checkpoint=draft, eagle_head=eagle_head, image=r.engine_runtime.image,
                                       image_digest=produced.get("image_digest"))
    template = builtin_chat_template(r.model.source)
    if template is not None:  # the built-in model's chat template (Dynamo's frontend and kiln's worker use it)
        (ctx.out_dir / "tensorrt_llm" / "1" / CHAT_TEMPLATE).write_text(template, encoding="utf-8")
    _keep_empty_dirs(ctx.out_dir)
    findings = lint_repository(ctx.out_dir)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise KilnError("the packaged repository fails kiln lint:\n  " + "\n  ".join(f.format() for f in errors))
    deploy = deploy_dir_for(ctx.final_dir) if llmapi_runtime(r) == "tensorrt_llm" and ctx.final_dir else None
    where = (f"container {info['container']}" if info["container"] else
             "CPU reference runtime (a test and development vehicle)")
    return PackageResult(summary=f"llmapi repository (1 model), lint clean, {where}", models=1,
                         container=info["container"] or "", deploy=str(deploy) if deploy else "")


KEEP_FILE = ".kiln-keep"


def _keep_empty_dirs(repo: Path) -> None:
    """A file in every empty directory (the ensemble's version folder): the repository travels as a cache entry of
    files, and an empty version folder that did not arrive leaves the ensemble unloadable ("No model version")."""
    for d in sorted(p for p in repo.rglob("*") if p.is_dir()):
        if not any(d.iterdir()):
            (d / KEEP_FILE).write_text("kept so that this folder survives transport as a remote-cache entry\n")


def _gpus_used(placement: Optional[Placement]) -> int:
    if placement is None:
        return 0
    ids = {int(i) for spec in (placement.target_devices, placement.draft_devices) for i in spec.split(",") if i}
    return max(ids) + 1 if ids else 0


def _sources_hash(loaded: LoadedRecipe) -> dict[str, str]:
    """The Python models kiln ships into repositories are inputs of the package step."""
    import hashlib

    from kiln.triton.repository import models_source

    h = hashlib.sha256()
    for p in sorted(models_source().rglob("*.py")):
        h.update(p.relative_to(models_source()).as_posix().encode() + p.read_bytes())
    from kiln.triton.repository import check_engine_script

    h.update(check_engine_script().read_bytes())
    hashes = {"triton_models": h.hexdigest()}
    if loaded is not None and loaded.recipe.target == "pytorch":
        from kiln.recipe.schema import llmapi_runtime

        hashes["llmapi_runtime"] = llmapi_runtime(loaded.recipe)  # `auto` depends on this machine
    sp = loaded.recipe.engine.speculative if loaded is not None else None
    if sp is not None and sp.mode == "eagle" and sp.draft_model and loaded.recipe.target == "pytorch":
        from kiln.models.loading import model_source_hash

        try:  # a local head is linked into the repository: its content is an input; a hub head is its id
            hashes["eagle_head"] = model_source_hash(sp.draft_model, key="engine.speculative.draft_model")
        except KilnError:
            hashes["eagle_head"] = "unreadable"
    ref = loaded.recipe.engine.speculative.draft_recipe if loaded is not None else None
    if ref and loaded.recipe.engine.speculative.mode == "draft_tokens_external":
        base = loaded.path.parent if loaded.path else Path(".")
        try:
            draft = load_recipe(base / ref).recipe
            hashes["draft_recipe"] = hashlib.sha256((base / ref).read_bytes()).hexdigest()
            hashes["draft_name"] = draft.name
        except (OSError, KilnError):
            hashes["draft_recipe"] = "unreadable"
    template = builtin_chat_template(loaded.recipe.model.source) if loaded is not None else None
    hashes["chat_template"] = hashlib.sha256((template or "").encode()).hexdigest()
    return hashes


def _output_dir(loaded: LoadedRecipe, repo_root: Path) -> Path:
    return repo_root / loaded.recipe.name


def required_files(recipe: Recipe) -> tuple[str, ...]:
    """kiln.json and every model's config.pbtxt (the draft model's too for draft+target decoding); target pytorch:
    the llmapi model's config.pbtxt, model.yaml and model.py."""
    if recipe.target == "pytorch":
        return ("kiln.json", "tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.yaml", "tensorrt_llm/1/model.py")
    models = ["preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"]
    if recipe.engine.speculative.mode == "draft_tokens_external" and recipe.engine.speculative.draft_recipe:
        models.append("tensorrt_llm_draft")
    return ("kiln.json",) + tuple(f"{m}/config.pbtxt" for m in models)


SPEC = StepSpec(
    name="package",
    fn=package,
    result=PackageResult,
    keys=("serving", "engine", "target", "model.dtype", "hardware.gpus_per_node", "hardware.gpu", "hardware.count",
          "parallelism"),
    files=required_files,
    after=("resolve", "quantize", "evaluate", "engine"),
    tools=("tritonclient",),
    input_hashes=_sources_hash,
    output_dir=_output_dir,
    finish=write_deploy,
)
