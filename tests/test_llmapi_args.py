"""Target pytorch without a server: the LLM arguments kiln emits against TensorRT-LLM 1.2.1's (kept as data with
their source), triton_config against the pinned llmapi model's handling, the config.pbtxt, validation through the
format registry (INT8 SmoothQuant refused before any work), the trtllm-serve options and the migration view."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kiln.recipe.loader import load_recipe
from kiln.recipe.rules import PYTORCH_REQUIRES
from kiln.recipe.schema import EngineSection, ServingSection, SpeculativeSection
from kiln.triton import llmapi
from kiln.triton.llmapi_repository import check_model_yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT = REPO_ROOT / "configs" / "tiny-llama.yaml"
DRAFT = REPO_ROOT / "configs" / "speculative" / "target-llama-3.1-8b.yaml"

#: Recipes whose model.yaml between them emits every key kiln can emit.
VARIANTS = [
    [],
    ["quantization.format=fp8", "quantization.kv_cache=fp8", "serving.cuda_graphs=true",
     "serving.kv_cache_host_memory_bytes=1000000", "serving.scheduler_policy=max_utilization",
     "serving.enable_chunked_context=true", "serving.streaming=false"],
    ["serving.cuda_graphs=false", "engine.max_seq_len=null", "model.dtype=bfloat16", "model.trust_remote_code=true"],
    ["engine.speculative.mode=ngram", "engine.speculative.max_draft_len=4",
     "engine.speculative.max_matching_ngram_size=3"],
    ["engine.speculative.mode=mtp", "engine.speculative.max_draft_len=3"],
    ["engine.speculative.mode=eagle", "engine.speculative.max_draft_len=3",
     "engine.speculative.draft_model=hf:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"],
]


def pytorch(*overrides: str, path: Path = DEFAULT):
    return load_recipe(path, ["target=pytorch", *overrides]).recipe


def _leaves(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        out.add(prefix + key)
        if isinstance(value, dict) and key != "triton_config":
            out |= _leaves(value, f"{prefix}{key}.")
    return out


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(o) or "default")
def test_every_emitted_model_yaml_key_is_a_pinned_llm_argument_of_the_right_type(overrides) -> None:
    data = llmapi.model_yaml(pytorch(*overrides), 512)
    assert check_model_yaml(data) == []


def test_the_variants_emit_every_key_kiln_writes() -> None:
    """The checks above cover what kiln can write: each key of every variant, and each of the data file's
    speculative types kiln maps a recipe mode to."""
    keys = set().union(*(_leaves(llmapi.model_yaml(pytorch(*o), 512)) for o in VARIANTS))
    assert {"kv_cache_config.host_cache_size", "kv_cache_config.max_tokens", "kv_cache_config.dtype",
            "cuda_graph_config", "cuda_graph_config.max_batch_size", "speculative_config.max_matching_ngram_size",
            "speculative_config.num_nextn_predict_layers", "speculative_config.speculative_model_dir",
            "enable_chunked_prefill", "scheduler_config.capacity_scheduler_policy", "triton_config"} <= keys
    spec = llmapi.llm_args_data()["speculative"]
    written = {spec["kiln_names"].get(kind, kind) for kind in llmapi.DECODING_TYPE.values()}
    assert written == {"Draft_Target", "Eagle3", "NGram", "MTP"}
    assert written <= {k for k, v in spec["variants"].items() if v["pytorch"]}


@pytest.mark.parametrize("edit, problem", [
    ({"kv_cache_config": {"free_gpu_memory_fraction": "0.9"}}, "kv_cache_config.free_gpu_memory_fraction: Input "
                                                               "should be a valid number"),
    ({"max_batch_size": True}, "max_batch_size: Input should be a valid integer"),
    ({"quant_config": {"quant_algo": "FP8"}}, "quant_config: unknown key"),  # TorchLlmArgs has none (checkpoint)
    ({"kv_cache_config": {"enable_kv_cache_reuse": True}}, "kv_cache_config.enable_kv_cache_reuse: unknown key"),
    ({"speculative_config": {"decoding_type": "Medusa", "max_draft_len": 4}}, "Medusa does not run on the PyTorch"),
    ({"speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 4}},
     "speculative_config.speculative_model: needed by Draft_Target"),
    # the older from_dict spelling: the 1.2 line's union has no such tag
    ({"speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 4}}, "Input tag 'DraftTarget'"),
    ({"scheduler_config": {"capacity_scheduler_policy": "guaranteed_no_evict"}},
     "scheduler_config.capacity_scheduler_policy"),
])
def test_the_check_refuses_what_upstream_refuses(edit, problem) -> None:
    data = llmapi.model_yaml(pytorch(), 512)
    args = {k: v for k, v in data.items() if k != "triton_config"}
    for key, value in edit.items():
        args[key] = {**args[key], **value} if isinstance(args.get(key), dict) and key != "speculative_config" else value
    problems = llmapi.check_llm_args(args)
    assert any(problem in p for p in problems), problems


@pytest.mark.parametrize("triton_config, problem", [
    ({"decoupled": True}, "triton_config.max_batch_size: required"),
    ({"decoupled": True, "max_batch_size": 8}, "only runs with 0"),
    ({"decoupled": "true", "max_batch_size": 0}, "triton_config.decoupled: 'true' is not a bool"),
    ({"decoupled": True, "max_batch_size": 0, "batching": True}, "triton_config.batching: not a key"),
    (None, "triton_config: missing"),
])
def test_triton_config_is_checked_against_the_llmapi_models_handling(triton_config, problem) -> None:
    assert any(problem in p for p in llmapi.check_triton_config(triton_config))


def test_the_data_files_name_their_sources_and_build() -> None:
    args, model = llmapi.llm_args_data(), llmapi.llmapi_model_data()
    for cls in args["classes"].values():
        assert cls["source"] in args["sources"]
    assert args["speculative"]["source"] in args["sources"]
    for source in list(args["sources"].values()) + list(model["sources"].values()):
        assert source["repo"] and source["path"] and source["commit"]
    assert set(llmapi.llm_args_model().model_fields) == set(args["classes"]["TorchLlmArgs"]["fields"])


def test_config_pbtxt_carries_what_triton_config_sets_and_upstreams_tensors() -> None:
    for streaming in (True, False):
        r = pytorch(f"serving.streaming={str(streaming).lower()}")
        config = text_format.Parse(llmapi.render_config(r), model_config_pb2.ModelConfig())
        tc = llmapi.triton_config_for(r)
        assert config.max_batch_size == tc["max_batch_size"] == 0
        assert config.model_transaction_policy.decoupled is tc["decoupled"] is streaming
        assert config.name == "tensorrt_llm" and config.backend == "python"
        inputs = {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims), t.optional) for t in config.input}
        from kiln.triton.repository import PROMPT_SCORING

        assert inputs == {t["name"]: (t["data_type"], t["dims"], t["optional"])
                          for t in llmapi.llmapi_model_data()["inputs"]} | {PROMPT_SCORING[0]: ("TYPE_BOOL", [1], True)}
        assert [t.name for t in config.output][-3:] == [name for name, _ in PROMPT_SCORING[1]], "kiln's extension"
        assert config.parameters["runtime"].string_value in ("reference", "tensorrt_llm")


def test_the_recipe_mapping_places_every_engine_and_serving_key() -> None:
    """A new recipe key must say what it becomes on target pytorch (kiln validate --set target=pytorch)."""
    keys = {f"engine.{k}" for k in EngineSection.model_fields if k != "speculative"} | \
        {f"engine.speculative.{k}" for k in SpeculativeSection.model_fields} | \
        {f"serving.{k}" for k in ServingSection.model_fields}
    assert set(llmapi.RECIPE_MAPPING) == keys
    assert {k for k, (kind, _) in llmapi.RECIPE_MAPPING.items() if kind == "refused"} == set(PYTORCH_REQUIRES)


def test_trtllm_serve_gets_the_same_arguments_under_the_pinned_flag() -> None:
    r = pytorch("serving.http_port=9000", "parallelism.tp=2")
    args = llmapi.llm_args_for(r, "/models/tensorrt_llm/1/checkpoint", 512)
    options = llmapi.trtllm_serve_options(args)
    assert "model" not in options and {k: v for k, v in args.items() if k != "model"} == options
    assert llmapi.check_llm_args({**options, "model": "x"}) == []
    cmd = llmapi.trtllm_serve_command(r, "/models/tensorrt_llm/1/checkpoint", "llm_options.yaml")
    assert cmd[:3] == ["trtllm-serve", "serve", "/models/tensorrt_llm/1/checkpoint"]
    assert cmd[cmd.index("--extra_llm_api_options") + 1] == "llm_options.yaml"
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[cmd.index("--tp_size") + 1] == "2"


def test_int8_smoothquant_on_pytorch_is_refused_by_validate_before_any_work(kiln, tmp_path) -> None:
    result = kiln("validate", DEFAULT, "--set", "target=pytorch", "--set", "quantization.format=int8_sq")
    assert result.exit_code == 2
    out = result.output
    assert "quantization.format: the pytorch target does not run INT8 SmoothQuant" in out
    assert "no linear method for W8A8_SQ_PER_CHANNEL" in out  # the reason, from the registry
    assert "fix: use quantization.format: fp8 instead" in out and "or target: tensorrt" in out  # the alternatives
    build = kiln("build", DEFAULT, "--set", "target=pytorch", "--set", "quantization.format=int8_sq",
                 "--build-dir", tmp_path / "build", "--repo-dir", tmp_path / "repo")
    assert build.exit_code == 2 and not (tmp_path / "build").exists()  # refused before any work


@pytest.mark.parametrize("overrides, needle", [
    (["quantization.format=int8_wo"], "ModelOpt 0.37 (the image's) exports INT8 weight-only"),
    (["quantization.kv_cache=int8"], "quantization.kv_cache: the pytorch target does not run INT8 KV cache"),
    (["quantization.format=nvfp4", "hardware.gpu=H100-SXM"], "NVFP4 needs SM 100+ but H100-SXM is SM 90"),
    (["serving.batching=v1"], "serving.batching: the PyTorch backend only batches in flight"),
    (["engine.speculative.mode=medusa", "engine.speculative.max_draft_len=4"], "does not run medusa"),
])
def test_validate_knows_the_pytorch_backends_limits(kiln, overrides, needle) -> None:
    result = kiln("validate", DEFAULT, "--set", "target=pytorch", *[w for o in overrides for w in ("--set", o)])
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_the_registry_refuses_awq_on_blackwell_rtx_for_the_pytorch_backend() -> None:
    """The 1.2.1 hardware matrix: W4A16/W4A8 AWQ on sm100/103 but not sm120 (kiln's GPU table has no SM 120 GPU, so
    this asks the registry by compute capability)."""
    from kiln.recipe.formats import format_refusal

    for fmt in ("int4_awq", "w4a8_awq"):
        assert format_refusal(fmt, "pytorch", 100) is None
        refusal = format_refusal(fmt, "pytorch", 120)
        assert refusal is not None and "sm120" in refusal.reason and "SM 120+" in refusal.reason
    assert format_refusal("int4_awq", "tensorrt", 100) is not None  # trtllm-build 1.2.1 refuses it there


def test_moving_a_recipe_shows_what_carries_over_changes_and_is_refused(kiln) -> None:
    result = kiln("validate", "configs/llama-3.1-8b/int8-sq.yaml", "--set", "target=pytorch")
    out = result.output
    assert result.exit_code == 2
    assert "carries over unchanged:" in out and "the same hashed calibration data" in out
    assert "engine.max_batch_size: 256 → max_batch_size = 256" in out
    assert "serving.kv_cache_free_gpu_mem_fraction: 0.9 → kv_cache_config.free_gpu_memory_fraction = 0.9" in out
    assert "engine.gemm_plugin: auto: a trtllm-build plugin flag" in out  # dropped, with why
    refused = out.split("refused (the errors below say how to fix each):")[1]
    assert "quantization.format: the pytorch target does not run INT8 SmoothQuant" in refused
    ok = kiln("validate", DEFAULT, "--set", "target=pytorch")
    assert ok.exit_code == 0 and "refused (the errors below say how to fix each):\n    nothing" in ok.output


def test_model_yaml_round_trips_through_yaml_with_its_types() -> None:
    data = llmapi.model_yaml(pytorch(*VARIANTS[1]), 512)
    loaded = yaml.safe_load(llmapi.dump_yaml(data, "# header"))
    assert loaded == data and check_model_yaml(copy.deepcopy(loaded)) == []


@pytest.mark.parametrize("value, want", [("true", "true"), ("false", "false"), ("null", None)])
def test_cuda_graphs_reach_both_gpu_targets(value: str, want) -> None:
    """serving.cuda_graphs: cuda_graph_config on target pytorch, the tensorrtllm backend's cuda_graph_mode on
    tensorrt (unset: each backend's own default)."""
    from kiln.triton.repository import standin_engine_config, trtllm_config

    args = llmapi.llm_args_for(pytorch(f"serving.cuda_graphs={value}"), "checkpoint", 512)
    assert args.get("cuda_graph_config", "absent") == {"true": {"max_batch_size": 32, "enable_padding": True},
                                                       "false": None, "null": "absent"}[value]
    r = load_recipe(DEFAULT, ["target=tensorrt", f"serving.cuda_graphs={value}"]).recipe
    config = trtllm_config(r, "tensorrt_llm", 512, standin_engine_config(r, 512))
    got = config.parameters["cuda_graph_mode"].string_value if "cuda_graph_mode" in config.parameters else None
    assert got == want


def test_pytorch_quantizes_in_the_engine_runtime_only_on_a_gpu_host_and_only_what_calibrates(monkeypatch) -> None:
    from kiln.recipe import schema

    monkeypatch.setattr(schema, "gpu_here", lambda: True)
    assert schema.quantization_runtime(pytorch()) == "engine"
    assert schema.quantization_runtime(pytorch("quantization.format=none")) == "host"  # nothing to calibrate
    assert schema.quantization_runtime(pytorch("quantization.format=none", "quantization.kv_cache=fp8")) == "engine"
    assert schema.llmapi_runtime(pytorch()) == "tensorrt_llm"
    monkeypatch.setattr(schema, "gpu_here", lambda: False)
    assert schema.quantization_runtime(pytorch()) == "host" and schema.llmapi_runtime(pytorch()) == "reference"
    assert schema.llmapi_runtime(pytorch("parallelism.tp=2")) == "tensorrt_llm"  # the reference runs one process


def test_tensorrt_llm_1_2_1_speculative_fields_and_the_speculative_model_alias() -> None:
    """1.2.1's DecodingBaseConfig (issue 20): `speculative_model` with `speculative_model_dir` as its alias,
    `draft_len_schedule`, `allow_advanced_sampling`; Eagle's `eagle3_model_arch`. A valid upstream model.yaml using
    them passes strict checking; a misspelling still fails."""
    base = {"model": "/m", "speculative_config": {"decoding_type": "Draft_Target", "max_draft_len": 4}}
    for spec in ({"speculative_model": "/d"}, {"speculative_model_dir": "/d"},
                 {"speculative_model": "/d", "draft_len_schedule": {1: 4, 8: 0}, "allow_advanced_sampling": True}):
        args = {**base, "speculative_config": {**base["speculative_config"], **spec}}
        assert llmapi.check_llm_args(args, "1.2.1") == [], spec
    eagle = {"model": "/m", "speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3,
                                                   "speculative_model": "/e", "eagle3_model_arch": "llama3"}}
    assert llmapi.check_llm_args(eagle, "1.2.1") == []
    typo = {**base, "speculative_config": {**base["speculative_config"], "speculative_models": "/d"}}
    assert any("speculative_models: unknown key" in p for p in llmapi.check_llm_args(typo, "1.2.1"))


@pytest.mark.parametrize("version", ["1.3.0rc29", "1.4.0rc2"])
def test_what_kiln_writes_for_1_3_and_1_4_passes_their_tables(version) -> None:
    """Issue 21: the 1.3/1.4 tables (from the release docs near each pin and a 1.3/1.4-era llm_args.py, see their
    `sources`). Every key kiln writes passes; the speculative union's tags are the release's (Draft_Target, Eagle3:
    the table's `kiln_names`); what a release dropped (onboard_blocks, 1.2's acceptance_window) is refused."""
    pin = f"engine_runtime.trtllm_version={version}"
    for overrides in VARIANTS:
        data = llmapi.model_yaml(pytorch(pin, *overrides), 512)
        args = {k: v for k, v in data.items() if k != "triton_config"}
        assert llmapi.check_llm_args(args, version) == [], overrides
    eagle = llmapi.model_yaml(pytorch(pin, *VARIANTS[-1]), 512)["speculative_config"]
    assert eagle["decoding_type"] == "Eagle3" and eagle["speculative_model_dir"]
    draft = llmapi.llm_args_for(load_recipe(DRAFT, ["target=pytorch", pin]).recipe, "ckpt", 512, "draft")
    assert draft["speculative_config"]["decoding_type"] == "Draft_Target"
    assert llmapi.check_llm_args(draft, version) == []
    assert llmapi.llm_args_for(load_recipe(DRAFT, ["target=pytorch"]).recipe, "ckpt", 512,
                               "draft")["speculative_config"]["decoding_type"] == "Draft_Target"  # 1.2.1 the same
    base = {"model": "/m", "speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 4,
                                                  "speculative_model_dir": "/d"}}
    assert any("Input tag 'DraftTarget'" in p for p in llmapi.check_llm_args(base, version))
    assert any("Input tag 'DraftTarget'" in p for p in llmapi.check_llm_args(base, "1.2.1"))
    for edit, problem in [({"kv_cache_config": {"onboard_blocks": True}}, "kv_cache_config.onboard_blocks: unknown"),
                          ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 4,
                                                   "acceptance_window": 8}}, "acceptance_window: unknown")]:
        assert any(problem in p for p in llmapi.check_llm_args({"model": "/m", **edit}, version)), edit
    data = llmapi.llm_args_data(version)
    for cls in data["classes"].values():
        assert cls["source"] in data["sources"]
        for field in cls["fields"].values():
            assert field.get("source", cls["source"]) in data["sources"]
    for variant in data["speculative"]["variants"].values():
        assert variant.get("source", data["speculative"]["source"]) in data["sources"]
    for source in data["sources"].values():
        assert source["repo"] and source["path"] and source["commit"]


@pytest.mark.parametrize("args, problem", [
    # TrtLlmArgs fields only in the 1.2-line llm_args.py: TorchLlmArgs (extra="forbid") refuses them
    ({"build_config": {"max_batch_size": 8}}, "build_config: unknown key"),
    ({"fail_fast_on_attention_window_too_large": True}, "fail_fast_on_attention_window_too_large: unknown key"),
    ({"backend": "tensorrt"}, "backend: Input should be 'pytorch'"),
    ({"stream_interval": 0}, "stream_interval: Input should be greater than 0"),
    ({"batch_wait_max_tokens_ratio": 1.5}, "batch_wait_max_tokens_ratio: Input should be less than or equal to 1"),
    ({"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "kv_cache_config.free_gpu_memory_fraction: Input should "
                                                             "be less than or equal to 1"),
    ({"kv_cache_config": {"max_attention_window": []}}, "kv_cache_config.max_attention_window: List should have at "
                                                        "least 1 item"),
    ({"cuda_graph_config": {"max_batch_size": -1}}, "cuda_graph_config.max_batch_size: Input should be greater than "
                                                    "or equal to 0"),
    ({"cuda_graph_config": {"batch_sizes": [1, 2, 4], "max_batch_size": 8}}, "max(batch_sizes) is 4"),
    ({"scheduler_config": {"waiting_queue_policy": "priority"}}, "scheduler_config.waiting_queue_policy"),
    ({"speculative_config": {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 0}},
     "speculative_config.max_matching_ngram_size: Input should be greater than 0"),
    ({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 0}},
     "speculative_config.num_nextn_predict_layers: Input should be greater than 0"),
    ({"speculative_config": {"decoding_type": "Eagle3", "max_draft_len": -1, "speculative_model": "/e"}},
     "speculative_config.max_draft_len: Input should be greater than or equal to 0"),
])
def test_the_1_2_1_table_refuses_what_the_1_2_line_llm_args_refuses(args, problem) -> None:
    """1.2.1.yaml compared with the 1.2-line llm_args.py (code-index 7019226376, `llm-args-1.2`): its constrained
    types (NonNegativeInt, PositiveInt, Field bounds), backend Literal['pytorch'], the fields it moved to TrtLlmArgs
    and CudaGraphConfig's batch_sizes/max_batch_size rule."""
    problems = llmapi.check_llm_args({"model": "/m", **args}, "1.2.1")
    assert any(problem in p for p in problems), problems


def test_the_1_2_1_table_takes_the_1_2_line_fields_kiln_did_not_know() -> None:
    args = {"model": "/m", "custom_tokenizer": "deepseek_v32", "pp_partition": [16, 16], "enable_sleep": False,
            "env_overrides": {"NCCL_DEBUG": "INFO"}, "max_stats_len": 100, "backend": "pytorch",
            "kv_cache_config": {"use_kv_cache_manager_v2": False, "max_util_for_resume": 0.9},
            "scheduler_config": {"waiting_queue_policy": "fcfs", "dynamic_batch_config": {}},
            "cuda_graph_config": {"batch_sizes": [1, 2, 8], "max_batch_size": 8},
            "speculative_config": {"decoding_type": "PARD", "max_draft_len": 4, "mask_token_id": 7}}
    assert llmapi.check_llm_args(args, "1.2.1") == []
    mtp = {"model": "/m", "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2,
                                                 "begin_thinking_phase_token": 1, "end_thinking_phase_token": 2}}
    assert llmapi.check_llm_args(mtp, "1.2.1") == []


def test_the_draft_checkpoint_is_named_by_its_container_path_outside_triton(tmp_path) -> None:
    """model.yaml names the draft checkpoint relative to the version directory (kiln's llmapi model.py resolves it);
    trtllm-serve and Dynamo's worker get its absolute path in the container, never the bare 'draft_checkpoint'
    (which TensorRT-LLM would look up in its working directory or as a Hugging Face Hub id)."""
    from kiln.triton.deploy.dynamo import DynamoDeploy, dynamo_image, write_dynamo_files

    recipe = load_recipe(DRAFT, ["target=pytorch"]).recipe
    args = llmapi.llm_args_for(recipe, llmapi.CHECKPOINT_DIR, 512, llmapi.DRAFT_DIR)
    assert args["speculative_config"]["speculative_model_dir"] == "draft_checkpoint"
    inside = "/models/tensorrt_llm/1/draft_checkpoint"
    assert llmapi.container_llm_args(args, "/models")["speculative_config"]["speculative_model_dir"] == inside
    assert args["speculative_config"]["speculative_model_dir"] == "draft_checkpoint"  # not changed in place
    write_dynamo_files(DynamoDeploy.from_recipe(recipe, dynamo_image(recipe)), args, tmp_path)
    options = yaml.safe_load((tmp_path / "dynamo" / "llm_options.yaml").read_text())
    assert options["speculative_config"]["speculative_model_dir"] == inside
    assert "model" not in options and llmapi.check_llm_args({**options, "model": "x"}) == []
