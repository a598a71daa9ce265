"""STAND-IN for TensorRT-LLM 1.2.1's `trtllm-build` (tests only; no engine is compiled, no GPU is used).

Its command line is upstream's: every flag, choice and default from kiln's copy of the 1.2.1 flag list
(src/kiln/steps/data/trtllm_build_flags.yaml, sourced from the 1.2.1 docs), parsed with argparse as upstream
does, so a flag upstream would reject fails here too. It writes an engine directory shaped like 1.2.1's:
config.json ({version, pretrained_config (the checkpoint's, logits_dtype as --logits_dtype sets it),
build_config (+ plugin_config, gather_context_logits)}) and one rank{N}.engine per checkpoint rank (a few stand-in bytes).
$KILN_STANDIN_ENGINE_OVERRIDE (JSON, dotted key → value) changes what the config says, to test that kiln reads
the engine back against the recipe.
"""

import argparse
import json
import os
import sys

import yaml

FLAGS = os.environ.get("KILN_STANDIN_FLAGS_FILE")


def parser(flags_file):
    with open(flags_file, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    p = argparse.ArgumentParser(prog="trtllm-build", allow_abbrev=False)
    for spec in data["flags"]:
        names = [spec["name"], *spec.get("aliases", [])]
        kind = spec["kind"]
        if kind == "store_true":
            p.add_argument(*names, action="store_true")
            continue
        kw = {"default": spec.get("default")}
        if spec.get("choices"):
            kw["choices"] = spec["choices"]
        elif kind == "bool_enable_disable":
            kw["choices"] = data["enable_disable"]
        if kind == "int":
            kw["type"] = int
        if spec.get("nargs"):
            kw["nargs"] = spec["nargs"]
        p.add_argument(*names, **kw)
    return p


def on(value, default=True):
    return default if value is None else value == "enable"


def main(argv):
    args = parser(FLAGS).parse_args(argv)
    with open(os.path.join(args.checkpoint_dir, "config.json"), encoding="utf-8") as fh:
        pretrained = json.load(fh)
    if args.logits_dtype:
        pretrained["logits_dtype"] = args.logits_dtype
    mapping = pretrained.get("mapping", {})
    max_seq_len = args.max_seq_len or pretrained.get("max_position_embeddings", 2048)
    config = {
        "version": "1.2.1",
        "pretrained_config": pretrained,
        "build_config": {
            "max_batch_size": args.max_batch_size, "max_input_len": args.max_input_len,
            "max_seq_len": max_seq_len + (args.max_draft_len or 0), "max_num_tokens": args.max_num_tokens,
            "max_beam_width": args.max_beam_width,
            "kv_cache_type": (args.kv_cache_type if args.kv_cache_type != "==SUPPRESS==" else "paged").upper(),
            "max_draft_len": args.max_draft_len or 0,
            # BuildConfig writes both switches (stored 1.x engine config.json files have them)
            "gather_context_logits": bool(args.gather_context_logits or args.gather_all_token_logits),
            "gather_generation_logits": bool(args.gather_generation_logits or args.gather_all_token_logits),
            "plugin_config": {"tokens_per_block": args.tokens_per_block, "context_fmha": on(args.context_fmha),
                              "use_paged_context_fmha": on(args.use_paged_context_fmha),
                              "remove_input_padding": on(args.remove_input_padding),
                              "paged_kv_cache": True, "gemm_plugin": args.gemm_plugin},
        },
    }
    for dotted, value in json.loads(os.environ.get("KILN_STANDIN_ENGINE_OVERRIDE", "{}")).items():
        node = config
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=4)
    for rank in range(mapping.get("world_size", 1)):
        with open(os.path.join(args.output_dir, f"rank{rank}.engine"), "wb") as fh:
            fh.write(b"stand-in engine: no TensorRT engine was compiled\n")
    print(f"[stand-in trtllm-build] wrote {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
