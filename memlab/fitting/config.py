"""The model `memlab.fit` is asked about, read and checked before transformers is imported: a preset name
(`fit_presets()`), a path to a config.json (or its folder), a dict of its contents, or a transformers
PretrainedConfig. `read_config` gives the plain dict, `check_config` fails in one line naming the first field of
the wrong type or sign or the shapes that do not divide, and `load_config` makes the transformers config.

The plain dict is also what names a measured run in memlab.fit's cache (`memlab.fitting.run`), so an answer that
was measured before is read back without importing transformers at all.
"""

from __future__ import annotations

import copy
import difflib
import json
import os

from ..core.validate import is_int, is_number

__all__ = ["CONFIG_DIR", "fit_presets", "read_config", "check_config", "load_config", "config_key"]

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_ALIASES = {"gpt2-small": "gpt2", "mistral-7b-v0.1": "mistral-7b", "llama2-7b": "llama-2-7b"}
_DROP = ("transformers_version", "_name_or_path")


def fit_presets() -> list[str]:
    """Names of the shipped model configs (memlab/fitting/configs/*.json, Hugging Face config.json contents)."""
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def read_config(model) -> dict:
    """The config.json contents of `model` as a plain dict, without importing transformers for a name, a path or a
    dict (a PretrainedConfig gives its own to_dict()). A file is read and checked (JSON, an object, a model_type)."""
    where = "the config"
    if isinstance(model, dict):
        d = copy.deepcopy(model)
    elif isinstance(model, (str, os.PathLike)):
        name = str(model).strip()
        key = _ALIASES.get(name.lower(), name.lower())
        path = os.path.join(CONFIG_DIR, key + ".json") if key in fit_presets() else name
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model must be a preset ({', '.join(fit_presets())}), a path to a config.json, a "
                             f"dict or a transformers PretrainedConfig; {name!r} is none of these")
        where = path
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"model: {path} is not a readable JSON config.json ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"model: {path} holds a JSON {type(d).__name__}, not a config.json object")
    elif hasattr(model, "to_json_string") and hasattr(model, "model_type"):      # a transformers PretrainedConfig
        d = json.loads(model.to_json_string(use_diff=False))
        d.setdefault("model_type", model.model_type)
    else:
        raise TypeError(f"model must be a preset name, a config.json path, a dict or a PretrainedConfig, "
                        f"got {type(model).__name__}")
    if "model_type" not in d:
        raise ValueError(f"model: {where} has no 'model_type' (a Hugging Face config.json names it)")
    if not isinstance(d["model_type"], str):
        raise ValueError(f"model: model_type must be a str naming a transformers architecture, got "
                         f"{d['model_type']!r}")
    for k in _DROP:
        d.pop(k, None)
    return d


# ----------------------------------------------------------------------------- the fields, checked
# The fields the architectures memlab.fit runs read for their shapes, under each family's own name.
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
HEAD_DIM = ("head_dim", "d_kv", "kv_channels")
DEPTHS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
          "num_decoder_layers")
POSITIVE = (*HIDDEN, *HEADS, *KV_HEADS, *HEAD_DIM, *DEPTHS, "vocab_size", "intermediate_size", "n_inner", "d_ff",
            "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim", "moe_intermediate_size",
            "max_position_embeddings", "n_positions", "num_local_experts", "num_experts", "n_routed_experts",
            "num_experts_per_tok", "sliding_window", "attention_chunk_size", "image_size", "patch_size",
            "num_channels", "num_labels", "first_k_dense_replace", "decoder_sparse_step", "n_shared_experts")
EPS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
PROBS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout", "activation_dropout",
         "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout_rate", "hidden_dropout", "classifier_dropout")
FLAGS = ("tie_word_embeddings", "is_decoder", "is_encoder_decoder", "use_cache")
OPTIONAL = ("n_inner", "sliding_window", "num_key_value_heads", "head_dim", "classifier_dropout",
            "attention_chunk_size", "num_kv_heads", "max_position_embeddings", "intermediate_size", "num_experts",
            "n_routed_experts", "n_shared_experts", "first_k_dense_replace")


def _first(d: dict, keys) -> tuple[str, object] | tuple[None, None]:
    for k in keys:
        if d.get(k) is not None:
            return k, d[k]
    return None, None


def check_config(d: dict) -> dict:
    """`d` (config.json contents) unchanged, or a ValueError in one line naming the first field that is of the
    wrong type or sign, or whose shapes do not divide (the heads into the hidden size, the key-value heads into the
    heads), or a per-layer list whose length is not the depth. Fields the model does not have are not asked for."""
    for k in POSITIVE:
        if k in d and not (d[k] is None and k in OPTIONAL):
            v = d[k]
            if not is_int(v) or v < 1:
                what = "a positive int" + (" or null" if k in OPTIONAL else "")
                raise ValueError(f"model: config field {k!r} must be {what}, got {v!r}")
    for k in EPS:
        if k in d and not (is_number(d[k]) and d[k] > 0):
            raise ValueError(f"model: config field {k!r} must be a positive number, got {d[k]!r}")
    for k in PROBS:
        if k in d and not (d[k] is None and k in OPTIONAL) and not (is_number(d[k]) and 0 <= d[k] <= 1):
            raise ValueError(f"model: config field {k!r} must be a probability in [0, 1], got {d[k]!r}")
    for k in FLAGS:
        if k in d and not isinstance(d[k], bool):
            raise ValueError(f"model: config field {k!r} must be true or false, got {d[k]!r}")
    hk, hidden = _first(d, HIDDEN)
    nk, heads = _first(d, HEADS)
    _, head_dim = _first(d, HEAD_DIM)
    if hidden and heads and head_dim is None and hidden % heads:
        raise ValueError(f"model: config field {hk!r} ({hidden}) must be a multiple of {nk!r} ({heads}): each head "
                         f"gets {hk} / {nk} features (or give head_dim)")
    kk, kv = _first(d, KV_HEADS)
    if kv and heads and heads % kv:
        raise ValueError(f"model: config field {nk!r} ({heads}) must be a multiple of {kk!r} ({kv}): each key-value "
                         f"head serves a group of query heads")
    ek, experts = _first(d, ("num_local_experts", "num_experts", "n_routed_experts"))
    k_top = d.get("num_experts_per_tok")
    if experts and k_top and k_top > experts:
        raise ValueError(f"model: config field 'num_experts_per_tok' ({k_top}) must be at most {ek!r} ({experts})")
    dk, depth = _first(d, DEPTHS)
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"model: config field 'layer_types' must be a list of str (one per layer), got "
                             f"{type(types).__name__}")
        if depth and len(types) != d.get("num_hidden_layers", depth):
            raise ValueError(f"model: config field 'layer_types' has {len(types)} entries for "
                             f"{d.get('num_hidden_layers', depth)} layers ({dk!r})")
    return d


def config_key(d: dict) -> str:
    """A config's plain dict as one canonical JSON string (what names its measured runs on disk)."""
    return json.dumps(d, sort_keys=True, default=str)


def load_config(model):
    """A transformers PretrainedConfig from a preset name (`fit_presets()`), a path to a config.json (or to the
    folder holding one), a dict of config.json contents, or a PretrainedConfig (copied). Read and checked
    (`read_config`, `check_config`) before transformers is imported, so a bad one fails at once in one line."""
    if not isinstance(model, (dict, str, os.PathLike)) and hasattr(model, "to_json_string"):
        from transformers import PretrainedConfig
        if isinstance(model, PretrainedConfig):
            check_config(read_config(model))
            return copy.deepcopy(model)
    d = check_config(read_config(model))
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from ..quant.llama import silence_libraries
    from .architectures import KINDS
    silence_libraries()
    kind = d["model_type"]
    if kind not in CONFIG_MAPPING_NAMES:
        near = difflib.get_close_matches(str(kind), CONFIG_MAPPING_NAMES, n=3)
        raise ValueError(f"model: model_type {kind!r}, which transformers {transformers.__version__} does not know"
                         + (f" (did you mean {', '.join(map(repr, near))}?)" if near else "")
                         + f"; memlab.fit runs {KINDS}")
    d = dict(d)
    untied = d.get("tie_word_embeddings") is False
    try:
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"model: transformers could not make a {kind!r} config from these fields "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})") from None
    if untied and getattr(cfg, "tie_word_embeddings", False):
        cfg.memlab_untied_head = True   # the config forces a tie the checkpoint does not have: the model is untied
    return cfg
