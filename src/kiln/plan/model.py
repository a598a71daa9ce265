"""Model shapes from Hugging Face ``config.json`` files, and the configs kiln ships.

Two decoder families are understood:

- **Llama-style** (``llama``, ``mistral``, ``qwen2``, … and any config with the same keys): separate
  q/k/v/o projections, a gated MLP (gate/up/down), RMSNorm (one weight vector per norm, two per layer).
  Grouped-query attention comes from ``num_key_value_heads`` (absent means one KV head per query head).
- **Falcon** (``falcon``, ``RefinedWeb``/``RefinedWebModel``): fused ``query_key_value``, a 4×hidden
  non-gated MLP, LayerNorm with bias; ``multi_query: true`` means one KV head.

Mixture-of-experts configs are refused: their active and stored parameters differ and this planner does
not model expert routing.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kiln.plan.errors import PlanError

__all__ = [
    "Linear",
    "ModelShape",
    "parse_model_config",
    "load_model_config",
    "shipped_model_config",
    "shipped_model_ids",
    "REQUIRED_LLAMA_FIELDS",
    "REQUIRED_FALCON_FIELDS",
]

REQUIRED_LLAMA_FIELDS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# Falcon configs spell these two ways (old RefinedWeb keys in brackets).
REQUIRED_FALCON_FIELDS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers (n_layer)",
    "num_attention_heads (n_head)",
)

_FALCON_TYPES = ("falcon", "refinedweb", "refinedwebmodel")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Defaults for ``tie_word_embeddings`` when a config omits it: the model class's own default in
# transformers. Anything else falls back to PretrainedConfig's default (True).
_TIE_DEFAULTS = {"llama": False, "mistral": False, "mixtral": False, "qwen2": False, "phi3": False}

# Shipped configs: HF repo id (lower-case) -> file under kiln/plan/data. Base and instruct variants of a
# model share the architecture, so both ids map to the same file.
_SHIPPED: dict[str, str] = {
    "meta-llama/llama-3.1-8b-instruct": "Llama-3.1-8B-Instruct.json",
    "meta-llama/llama-3.1-8b": "Llama-3.1-8B-Instruct.json",
    "meta-llama/meta-llama-3.1-8b-instruct": "Llama-3.1-8B-Instruct.json",
    "meta-llama/llama-3.1-70b-instruct": "Llama-3.1-70B-Instruct.json",
    "meta-llama/llama-3.1-70b": "Llama-3.1-70B-Instruct.json",
    "meta-llama/meta-llama-3.1-70b-instruct": "Llama-3.1-70B-Instruct.json",
    "meta-llama/llama-3.2-1b-instruct": "Llama-3.2-1B-Instruct.json",
    "meta-llama/llama-3.2-1b": "Llama-3.2-1B-Instruct.json",
}


@dataclass(frozen=True)
class Linear:
    """One weight matrix (or one part of a fused one) of a decoder layer.

    ``shard`` says how tensor parallelism splits it: ``col`` splits the output features, ``row`` the
    input features, ``kv`` splits KV heads (and replicates them when tp > KV heads).
    """

    name: str
    in_features: int
    out_features: int
    shard: str
    bias: bool = False

    @property
    def params(self) -> int:
        """Unsharded parameter count (weight plus bias)."""
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class ModelShape:
    """The figures the planner needs from a model config, with the assumptions made to get them."""

    name: str
    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mlp_gated: bool
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    norm_params_per_layer: int
    final_norm_params: int
    max_position_embeddings: int | None
    torch_dtype: str | None
    assumptions: tuple[str, ...] = field(default=())

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_kind(self) -> str:
        """``MHA`` (one KV head per query head), ``MQA`` (one KV head) or ``GQA`` (in between)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    def layer_linears(self, layer: int) -> list[Linear]:
        """The weight matrices of decoder layer ``layer``, named as in the Hugging Face checkpoint."""
        h, q, kv, inter = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        if self.family == "falcon":
            p = f"transformer.h.{layer}"
            # query_key_value is one fused matrix; its query and key/value parts shard differently.
            return [
                Linear(f"{p}.self_attention.query_key_value", h, q, "col", self.qkv_bias),
                Linear(f"{p}.self_attention.query_key_value", h, 2 * kv, "kv", self.qkv_bias),
                Linear(f"{p}.self_attention.dense", q, h, "row", self.o_bias),
                Linear(f"{p}.mlp.dense_h_to_4h", h, inter, "col", self.mlp_bias),
                Linear(f"{p}.mlp.dense_4h_to_h", inter, h, "row", self.mlp_bias),
            ]
        p = f"model.layers.{layer}"
        linears = [
            Linear(f"{p}.self_attn.q_proj", h, q, "col", self.qkv_bias),
            Linear(f"{p}.self_attn.k_proj", h, kv, "kv", self.qkv_bias),
            Linear(f"{p}.self_attn.v_proj", h, kv, "kv", self.qkv_bias),
            Linear(f"{p}.self_attn.o_proj", q, h, "row", self.o_bias),
        ]
        if self.mlp_gated:
            linears.append(Linear(f"{p}.mlp.gate_proj", h, inter, "col", self.mlp_bias))
        linears += [
            Linear(f"{p}.mlp.up_proj", h, inter, "col", self.mlp_bias),
            Linear(f"{p}.mlp.down_proj", inter, h, "row", self.mlp_bias),
        ]
        return linears

    @property
    def embedding_name(self) -> str:
        return "transformer.word_embeddings" if self.family == "falcon" else "model.embed_tokens"

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """Parameters of lm_head stored separately from the embedding (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its matrices, biases and norms."""
        return sum(lin.params for lin in self.layer_linears(0)) + self.norm_params_per_layer

    def total_params(self) -> int:
        """All stored parameters: embedding, layers, final norm, and lm_head unless tied."""
        return (
            self.embedding_params
            + self.num_layers * self.layer_params()
            + self.final_norm_params
            + self.lm_head_params
        )

    def summary(self) -> dict[str, Any]:
        """JSON-ready description of the shape (used in the plan's JSON)."""
        return {
            "name": self.name,
            "model_type": self.model_type,
            "family": self.family,
            "params": self.total_params(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "attention": self.attention_kind,
            "intermediate_size": self.intermediate_size,
            "mlp": "gated" if self.mlp_gated else "plain",
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.torch_dtype,
            "assumptions": list(self.assumptions),
        }


def _positive_int(config: dict[str, Any], key: str, where: str) -> int:
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{where}: `{key}` must be a positive integer, got {value!r}")
    return value


def _first_key(config: dict[str, Any], *keys: str) -> str | None:
    return next((k for k in keys if config.get(k) is not None), None)


def _model_type(config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type:
        return model_type.lower()
    archs = config.get("architectures") or []
    if archs and isinstance(archs[0], str):
        arch = archs[0].lower()
        if arch.startswith(("falcon", "rw")):
            return "falcon"
        return arch.removesuffix("forcausallm")
    return "unknown"


def _name(config: dict[str, Any], model_type: str) -> str:
    for key in ("_name_or_path", "name_or_path"):
        value = config.get(key)
        if isinstance(value, str) and value:
            return value
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else model_type


def _check_not_moe(config: dict[str, Any], where: str) -> None:
    for key in _MOE_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 1:
            raise PlanError(
                f"{where}: mixture-of-experts models (`{key}: {value}`) are not supported by the planner; "
                "it models dense Llama-style and Falcon decoders only"
            )


def _missing(config: dict[str, Any], groups: tuple[tuple[str, ...], ...]) -> list[str]:
    return [" or ".join(g) for g in groups if _first_key(config, *g) is None]


def _head_dims(config: dict[str, Any], hidden: int, heads: int, where: str) -> tuple[int, list[str]]:
    notes: list[str] = []
    if config.get("head_dim") is not None:
        return _positive_int(config, "head_dim", where), notes
    if hidden % heads:
        raise PlanError(
            f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}; "
            "add `head_dim` to the config"
        )
    notes.append(f"head_dim = hidden_size / num_attention_heads = {hidden // heads}")
    return hidden // heads, notes


def _parse_falcon(config: dict[str, Any], model_type: str, where: str) -> ModelShape:
    missing = _missing(
        config,
        (("vocab_size",), ("hidden_size",), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head")),
    )
    if missing:
        raise PlanError(
            f"{where}: model config is missing {', '.join(missing)} "
            f"(a Falcon config needs: {', '.join(REQUIRED_FALCON_FIELDS)})"
        )
    layers_key = _first_key(config, "num_hidden_layers", "n_layer")
    heads_key = _first_key(config, "num_attention_heads", "n_head")
    assert layers_key and heads_key
    hidden = _positive_int(config, "hidden_size", where)
    heads = _positive_int(config, heads_key, where)
    head_dim, notes = _head_dims(config, hidden, heads, where)
    new_arch = bool(config.get("new_decoder_architecture", False))
    if new_arch:
        kv_key = _first_key(config, "num_kv_heads", "n_head_kv", "num_key_value_heads")
        kv_heads = _positive_int(config, kv_key, where) if kv_key else heads
    elif config.get("multi_query", True):
        kv_heads = 1
        notes.append("multi_query: one KV head shared by all query heads")
    else:
        kv_heads = heads
    inter = config.get("ffn_hidden_size") or 4 * hidden
    if config.get("ffn_hidden_size") is None:
        notes.append(f"MLP width = 4 × hidden_size = {inter} (Falcon default)")
    bias = bool(config.get("bias", False))
    # LayerNorm with weight and bias: one per layer with parallel attention (old architecture),
    # two otherwise (ln_attn + ln_mlp, or input + post-attention).
    parallel = bool(config.get("parallel_attn", True))
    norms_per_layer = 1 if (parallel and not new_arch) else 2
    tie = bool(config.get("tie_word_embeddings", True))
    if "tie_word_embeddings" not in config:
        notes.append("tie_word_embeddings not set: Falcon ties lm_head to the embedding (transformers default)")
    return ModelShape(
        name=_name(config, model_type),
        model_type=model_type,
        family="falcon",
        vocab_size=_positive_int(config, "vocab_size", where),
        hidden_size=hidden,
        num_layers=_positive_int(config, layers_key, where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(inter),
        mlp_gated=False,
        tie_word_embeddings=tie,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        norm_params_per_layer=norms_per_layer * 2 * hidden,
        final_norm_params=2 * hidden,
        max_position_embeddings=config.get("max_position_embeddings"),
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        assumptions=tuple(notes),
    )


def _parse_llama(config: dict[str, Any], model_type: str, where: str) -> ModelShape:
    missing = [k for k in REQUIRED_LLAMA_FIELDS if config.get(k) is None]
    if missing:
        raise PlanError(
            f"{where}: model config is missing {', '.join(missing)} "
            f"(a Llama-style config needs: {', '.join(REQUIRED_LLAMA_FIELDS)}; optional: "
            "num_key_value_heads, head_dim, tie_word_embeddings, attention_bias, mlp_bias)"
        )
    hidden = _positive_int(config, "hidden_size", where)
    heads = _positive_int(config, "num_attention_heads", where)
    head_dim, notes = _head_dims(config, hidden, heads, where)
    if config.get("num_key_value_heads") is None:
        kv_heads = heads
        notes.append("num_key_value_heads not set: one KV head per query head (multi-head attention)")
    else:
        kv_heads = _positive_int(config, "num_key_value_heads", where)
    if heads % kv_heads:
        raise PlanError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if "tie_word_embeddings" in config:
        tie = bool(config["tie_word_embeddings"])
    else:
        tie = _TIE_DEFAULTS.get(model_type, True)
        notes.append(f"tie_word_embeddings not set: {tie} (transformers default for {model_type!r})")
    if model_type not in _TIE_DEFAULTS:
        notes.append(f"model_type {model_type!r} planned as a Llama-style decoder (gated MLP, RMSNorm)")
    qkv_bias = bool(config.get("attention_bias", model_type == "qwen2"))
    return ModelShape(
        name=_name(config, model_type),
        model_type=model_type,
        family="llama",
        vocab_size=_positive_int(config, "vocab_size", where),
        hidden_size=hidden,
        num_layers=_positive_int(config, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_positive_int(config, "intermediate_size", where),
        mlp_gated=True,
        tie_word_embeddings=tie,
        qkv_bias=qkv_bias,
        o_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        norm_params_per_layer=2 * hidden,
        final_norm_params=hidden,
        max_position_embeddings=config.get("max_position_embeddings"),
        torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        assumptions=tuple(notes),
    )


def parse_model_config(config: dict[str, Any], where: str = "model config") -> ModelShape:
    """The planner's view of a Hugging Face ``config.json`` dict.

    ``where`` names the source in error messages (a file path or a model id). Raises PlanError naming
    the missing or invalid fields and listing the required ones.
    """
    if not isinstance(config, dict):
        raise PlanError(f"{where}: expected a JSON object (config.json content), got {type(config).__name__}")
    _check_not_moe(config, where)
    model_type = _model_type(config)
    if model_type in _FALCON_TYPES:
        return _parse_falcon(config, model_type, where)
    return _parse_llama(config, model_type, where)


def load_model_config(path_or_dir: str | Path) -> dict[str, Any]:
    """Read a model's ``config.json`` (the file itself, or a Hugging Face model directory holding it).

    The content is validated with :func:`parse_model_config`, so a config missing required fields fails
    here with a PlanError that names them.
    """
    path = Path(path_or_dir).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(
            f"model config not found: {path} (give a config.json file or a Hugging Face model directory)"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not a readable JSON model config ({exc})") from exc
    parse_model_config(config, where=str(path))
    return config


def _repo_id(source: str) -> str:
    text = source.strip()
    if text.startswith("hf:"):
        text = text[3:]
    return text.split("@", 1)[0].strip().strip("/").lower()


def shipped_model_ids() -> list[str]:
    """Hugging Face ids (lower-case) whose configs ship with kiln, so planning them needs no download."""
    return sorted(_SHIPPED)


def shipped_model_config(source: str) -> dict[str, Any] | None:
    """The shipped ``config.json`` for a model source such as ``hf:meta-llama/Llama-3.1-8B-Instruct@main``.

    The ``hf:`` prefix and an ``@revision`` are optional and ignored (revisions do not change the
    architecture); matching is case-insensitive. None when no config ships for that model.
    """
    filename = _SHIPPED.get(_repo_id(source))
    if filename is None:
        return None
    text = resources.files("kiln.plan").joinpath("data", filename).read_text(encoding="utf-8")
    config = json.loads(text)
    config.setdefault("_name_or_path", _canonical_id(filename))
    return copy.deepcopy(config)


def _canonical_id(filename: str) -> str:
    return "meta-llama/" + filename.removesuffix(".json")
