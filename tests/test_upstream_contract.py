"""Sanity checks on the upstream-contract data (TensorRT-LLM 1.2 flags, Triton layout in src/kiln/triton/data)."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from kiln.steps import trtllm_flags as tf
from kiln.triton import upstream as up

# ----------------------------------------------------------------------------- Triton contract


@pytest.mark.parametrize("model_name", sorted(up.MODELS))
def test_tensor_names_unique_within_inputs_and_within_outputs(model_name: str) -> None:
    model = up.MODELS[model_name]
    for kind, specs in (("input", model.inputs), ("output", model.outputs)):
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        assert not duplicates, f"{model_name} {kind}s repeat {duplicates}"


@pytest.mark.parametrize("model_name", sorted(up.MODELS))
def test_tensor_specs_are_well_formed(model_name: str) -> None:
    model = up.MODELS[model_name]
    for spec in (*model.inputs, *model.outputs):
        var = spec.template_var
        if var is None:
            assert re.fullmatch(r"TYPE_[A-Z0-9]+", spec.data_type), spec
        else:
            assert var in up.TEMPLATED_DATA_TYPES, spec
            assert var in model.template_vars, spec
        assert spec.dims and all(d == -1 or d > 0 for d in spec.dims), spec
        if spec.reshape is not None:
            assert spec.dims == (1,) and spec.reshape == (), spec
    for spec in model.outputs:
        assert not spec.optional and not spec.allow_ragged_batch, spec


def _concrete_types(data_type: str) -> set[str]:
    if data_type.startswith("${"):
        return set(up.TEMPLATED_DATA_TYPES[data_type[2:-1]])
    return {data_type}


def test_ensemble_wiring_targets_exist_and_types_agree() -> None:
    ensemble = up.MODELS["ensemble"]
    assert [s.model_name for s in ensemble.steps] == ["preprocessing", "tensorrt_llm", "postprocessing"]
    available = {s.name: s for s in ensemble.inputs}  # tensors a step may consume
    produced: dict[str, str] = {}
    for step in ensemble.steps:
        model = up.MODELS[step.model_name]
        for model_tensor, ensemble_tensor in step.input_map:
            target = model.input(model_tensor)
            assert ensemble_tensor in available, f"{step.model_name}.{model_tensor} reads unknown {ensemble_tensor}"
            source = available[ensemble_tensor]
            assert _concrete_types(source.data_type) & _concrete_types(target.data_type), (
                f"{ensemble_tensor} ({source.data_type}) -> {step.model_name}.{model_tensor} ({target.data_type})"
            )
        mapped_inputs = {m for m, _ in step.input_map}
        missing = [s.name for s in model.inputs if not s.optional and s.name not in mapped_inputs]
        assert not missing, f"required inputs of {step.model_name} left unmapped: {missing}"
        for model_tensor, ensemble_tensor in step.output_map:
            out = model.output(model_tensor)
            assert ensemble_tensor not in produced, f"{ensemble_tensor} produced twice"
            produced[ensemble_tensor] = step.model_name
            available[ensemble_tensor] = out
    for out in ensemble.outputs:
        assert out.name in produced, f"ensemble output {out.name} is produced by no step"
        assert _concrete_types(available[out.name].data_type) & _concrete_types(out.data_type), out.name


def test_client_facing_names_match_the_guide() -> None:
    ensemble = up.MODELS["ensemble"]
    assert ensemble.input("text_input") == up.TensorSpec("text_input", "TYPE_STRING", (1,))
    assert ensemble.input("max_tokens") == up.TensorSpec("max_tokens", "TYPE_INT32", (1,))
    assert ensemble.output("text_output").dims == (-1,)
    trt = up.MODELS["tensorrt_llm"]
    assert trt.input("input_ids").allow_ragged_batch
    assert trt.input("input_lengths").reshape == ()
    assert trt.input("stop_words_list").dims == (2, -1)
    assert trt.output("output_ids").dims == (-1, -1)
    assert trt.decoupled == "templated" and trt.backend == "${triton_backend}"
    with pytest.raises(KeyError, match="tensorrt_llm input 'nope'"):
        trt.input("nope")


@pytest.mark.parametrize("model_name", sorted(up.MODELS))
def test_parameters_are_consistent(model_name: str) -> None:
    model = up.MODELS[model_name]
    for key, param in model.parameters.items():
        assert key == param.key
        if param.kind == "fixed":
            assert param.fixed_value and param.template_var is None, key
            continue
        assert param.template_var in model.template_vars, key
        if param.kind in ("choice", "bool"):
            assert param.allowed, key
        if param.default is not None and param.allowed is not None:
            assert param.default in param.allowed, key


def test_tensorrt_llm_parameter_facts() -> None:
    params = up.MODELS["tensorrt_llm"].parameters
    assert params["gpt_model_path"].template_var == "engine_dir"
    assert params["gpt_model_type"].required and "inflight_fused_batching" in (params["gpt_model_type"].allowed or ())
    assert params["batch_scheduler_policy"].default == "guaranteed_no_evict"
    assert params["enable_kv_cache_reuse"].default == "true"
    assert params["kv_cache_free_gpu_mem_fraction"].default == "0.9"
    assert set(params["decoding_mode"].allowed or ()) >= {"top_k_top_p", "beam_search", "eagle"}
    assert "max_queue_delay_microseconds" not in params  # a dynamic_batching field, not a parameter
    assert "max_queue_delay_microseconds" in up.MODELS["tensorrt_llm"].template_vars


def test_contract_parses_as_a_real_triton_model_config() -> None:
    """Render every model into Triton's own ModelConfig proto: names, enums and fields must all exist."""
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    for model in up.MODELS.values():
        config = model_config_pb2.ModelConfig(name=model.name, max_batch_size=8)
        for specs, field in ((model.inputs, config.input), (model.outputs, config.output)):
            for spec in specs:
                data_type = sorted(_concrete_types(spec.data_type))[0]
                tensor = field.add(name=spec.name, data_type=model_config_pb2.DataType.Value(data_type))
                tensor.dims.extend(spec.dims)
                if spec.reshape is not None:
                    tensor.reshape.shape.extend(spec.reshape)
                if specs is model.inputs:
                    tensor.optional = spec.optional
                    tensor.allow_ragged_batch = spec.allow_ragged_batch
        for key, param in model.parameters.items():
            config.parameters[key].string_value = param.fixed_value or param.default or ""
        assert len(config.input) == len(model.inputs)


def test_container_for_known_and_unknown_versions() -> None:
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:26\.0\d-trtllm-python-py3", up.container_for("1.2.1"))
    assert up.container_for("1.2.1") == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    assert up.container_for("1.2.0") == "nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3"
    assert up.container_for("1.1.0") == "nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3"
    assert up.NGC_CONTAINERS["1.1.0"][0].endswith(":25.12-trtllm-python-py3")
    assert up.CONTAINER_TENSORRT[up.container_for("1.2.1")] == "10.14.1.48"
    with pytest.raises(LookupError, match=r"1\.3\.0.*known versions: .*1\.2\.1"):
        up.container_for("1.3.0")


def test_every_model_and_table_names_its_source() -> None:
    for name, model in up.MODELS.items():
        assert model.source is not None, name
        assert model.source.repo == "NVIDIA/TensorRT-LLM", name
        assert model.source.path.endswith(f"/inflight_batcher_llm/{name}/config.pbtxt"), model.source
        assert re.fullmatch(r"[0-9a-f]{40}", model.source.commit), model.source
    assert set(up.MODELS) == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
    for key, source in up.UPSTREAM_SOURCE.items():
        assert "/" in source.repo and source.path and source.commit, key
    assert up.UPSTREAM_SOURCE["containers"].path == "docs/introduction/compatibility.md"


def _contract_text() -> str:
    return (resources.files("kiln.triton") / "data" / up.CONTRACT_FILE).read_text(encoding="utf-8")


def test_bool_spelling_sets_resolve_by_name() -> None:
    raw = json.loads(_contract_text())
    named = raw["models"]["tensorrt_llm"]["parameters"]["enable_kv_cache_reuse"]["allowed"]
    assert named == "cpp_bool"
    assert up.MODELS["tensorrt_llm"].parameters["enable_kv_cache_reuse"].allowed == tuple(
        raw["spellings"]["cpp_bool"]["values"]
    )


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d["models"]["ensemble"]["inputs"][0].update(dims="1"), "models.ensemble.inputs.0.dims"),
        (lambda d: d["models"]["ensemble"]["inputs"][0].update(shape=[1]), "models.ensemble.inputs.0.shape"),
        (lambda d: d["models"]["tensorrt_llm"].update(decoupled="yes"), "models.tensorrt_llm.decoupled"),
        (lambda d: d["models"]["postprocessing"]["source"].pop("commit"), "models.postprocessing.source.commit"),
    ],
)
def test_a_malformed_contract_file_names_the_key_path(mutate, fragment: str) -> None:
    data = json.loads(_contract_text())
    mutate(data)
    with pytest.raises(up.ContractDataError, match=re.escape(f"{up.CONTRACT_FILE}: ") + ".*" + re.escape(fragment)):
        up._parse(up.CONTRACT_FILE, json.dumps(data), up._ContractFile)


def test_an_unknown_spelling_set_is_refused() -> None:
    data = json.loads(_contract_text())
    data["models"]["tensorrt_llm"]["parameters"]["enable_kv_cache_reuse"]["allowed"] = "yaml_bool"
    parsed = up._parse(up.CONTRACT_FILE, json.dumps(data), up._ContractFile)
    with pytest.raises(up.ContractDataError, match="enable_kv_cache_reuse.allowed: 'yaml_bool' names no spelling"):
        up._model("tensorrt_llm", parsed.models["tensorrt_llm"], {k: v.values for k, v in parsed.spellings.items()})


# ------------------------------------------------------------------------- trtllm-build flags


def test_flag_table_shape() -> None:
    for name, spec in tf.BUILD_FLAGS.items():
        assert name == spec.name and name.startswith("--")
        if spec.kind in ("choice", "bool_enable_disable"):
            assert spec.choices, name
            if isinstance(spec.default, str) and spec.default != tf.SUPPRESSED:
                assert spec.default in spec.choices, name
        else:
            assert spec.choices is None, name
    assert set(tf.ALIASES) == {"--max_decoder_seq_len", "--max_multimodal_len"}
    # 1.2.1 help page: 29 general + 4 logits + 4 LoRA + 2 speculative + 28 PluginConfig flags
    assert len(tf.BUILD_FLAGS) == 67
    assert sum(spec.group == "plugin" for spec in tf.BUILD_FLAGS.values()) == 28
    assert not set(tf.REMOVED_FLAGS) & set(tf.BUILD_FLAGS)


def test_flag_defaults_match_upstream_1_2_1() -> None:
    flags = tf.BUILD_FLAGS
    assert flags["--max_batch_size"].default == 2048
    assert flags["--max_input_len"].default == 1024
    assert flags["--max_num_tokens"].default == 8192
    assert flags["--max_seq_len"].default is None
    assert flags["--tokens_per_block"].default == 32
    assert flags["--gemm_plugin"].default is None and "nvfp4" in (flags["--gemm_plugin"].choices or ())
    assert flags["--gpt_attention_plugin"].default == "auto"
    assert flags["--use_paged_context_fmha"].default == "enable"
    assert flags["--multiple_profiles"].default == "disable"
    assert flags["--kv_cache_type"].default == tf.SUPPRESSED
    assert flags["--paged_kv_cache"].deprecated


def test_check_flags_accepts_a_typical_build() -> None:
    argv = [
        "--checkpoint_dir", "/ckpt", "--output_dir", "/engine",
        "--max_batch_size", "64", "--max_input_len=2048", "--max_decoder_seq_len", "4096",
        "--gemm_plugin", "auto", "--kv_cache_type", "PAGED", "--use_paged_context_fmha", "enable",
        "--lora_target_modules", "attn_q", "attn_v", "--strip_plan", "--workers", "2",
    ]  # fmt: skip
    assert tf.check_flags(argv) == []


def test_check_flags_reports_unknown_removed_and_bad_values() -> None:
    problems = tf.check_flags(
        [
            "--max_batch_sise", "8",
            "--tp_size", "2",
            "--gemm_plugin", "fp16",
            "--max_num_tokens", "lots",
            "--strip_plan=yes",
            "stray",
            "--context_fmha",
        ]
    )  # fmt: skip
    text = "\n".join(problems)
    assert "--max_batch_sise: unknown trtllm-build 1.2 flag; did you mean --max_batch_size?" in text
    assert "--tp_size: not accepted by trtllm-build 1.2 (parallelism" in text
    assert "--gemm_plugin: 'fp16' is not one of" in text
    assert "--max_num_tokens: expected an integer, got 'lots'" in text
    assert "--strip_plan: takes no value" in text
    assert "--context_fmha: needs a value" in text
    # an unknown flag's value cannot be attributed, so it surfaces as a positional too
    assert "'8': unexpected positional argument (trtllm-build takes only flags)" in problems
    assert "'stray': unexpected positional argument (trtllm-build takes only flags)" in problems


def test_check_flags_reports_repeats_and_bad_list_members() -> None:
    problems = tf.check_flags(["--workers", "1", "--workers", "2", "--lora_target_modules", "attn_q", "bogus"])
    assert problems == [
        "--workers: given more than once",
        "--lora_target_modules: 'bogus' is not one of "
        + ", ".join(tf.BUILD_FLAGS["--lora_target_modules"].choices or ()),
    ]


def test_quant_algo_values() -> None:
    """TensorRT-LLM 1.2.1's QuantAlgo lists live in the format registry, with their source (mode.py)."""
    from kiln.recipe.formats import registry

    reg = registry()
    algos = reg.trtllm_quant_algos
    assert "INT8" not in algos.quant_algos and "INT8" in algos.kv_cache_quant_algos
    assert {"FP8", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL", "W4A8_AWQ", "NVFP4", "MIXED_PRECISION"} <= algos.quant_algos
    assert set(algos.kv_cache_quant_algos) == {"FP8", "INT8", "NVFP4"}
    assert len(algos.members) == 25 and len(set(algos.members)) == 25
    assert "quantization/mode.html" in reg.sources[algos.source].path
    assert reg.sources[algos.source].commit == "58fb435eacc402f3bd177e60f592c955d2b0719d"


def test_flag_table_data_names_its_sources() -> None:
    assert tf.TRTLLM_VERSION_SOURCE["version"] == "1.2.1"
    assert tf.TRTLLM_VERSION_SOURCE["flags"]["path"].startswith("1.2.1/commands/trtllm-build.html")
    assert tf.SM_100_UNSUPPORTED_PLUGIN_FLAGS <= set(tf.BUILD_FLAGS)
    assert tf.FP8_CONTEXT_FMHA_MIN_SM == 89
