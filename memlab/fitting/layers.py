"""Every layer of the model as its config builds it. Most decoders repeat one layer, and `memlab.fit` runs 2 and 3
of them and extends linearly (`memlab.fitting.run`). Some mix kinds of layer: Gemma-2/3 and GPT-OSS interleave
sliding-window and global attention (`layer_types`), Llama 4 chunked and global attention and MoE with dense
layers, DeepSeek-V3 starts with dense layers before its MoE ones (`first_k_dense_replace`), Qwen-MoE keeps some
layers dense (`mlp_only_layers`, `decoder_sparse_step`). For those each kind of layer is measured on its own:

    kinds       the layers' kinds, found by building the model on the meta device (nothing is allocated) and
                comparing each layer's modules, parameter shapes, attention type and window (`layer_kinds`)
    base run    layers 0 and 1 as they are, then one layer of each kind present, the model's last kind last
    kind runs   the base run with one more layer of kind k before the last one, for each kind k
    extension   the base run + for every further layer i of the model, (kind run of i's kind - base run)

Every run holds every kind, so whatever is built once per forward for a kind (a sliding-window mask) is in all of
them and cancels; each difference is exactly one more layer of that kind in the middle of the stack. The layers of
a run are taken from a model built to the depth of the last one picked (`select_layers`), each keeping what its
place in the full model gave it; `layer_idx` is renumbered, and the per-layer lists of the config cut to match.
"""

from __future__ import annotations

import torch

__all__ = ["layer_kinds", "kind_runs", "select_layers", "combine"]

# config fields that make layers differ by their index, besides a per-layer list
_INTERLEAVE = {"first_k_dense_replace": 0, "decoder_sparse_step": 1, "moe_layer_freq": 1,
               "interleave_moe_layer_step": 1, "mlp_only_layers": [], "moe_layers": None, "no_rope_layers": None,
               "attn_layer_period": None, "expert_layer_period": None, "sliding_window_pattern": None}
_ATTRS = ("sliding_window", "is_sliding", "attention_type", "layer_type", "use_rope", "is_causal")


def _get(cfg, key):
    try:
        return getattr(cfg, key)
    except AttributeError:
        return None


def _maybe_mixed(cfg, depth: int) -> bool:
    """Does the config say its layers may differ? (a per-layer list with more than one value, or an interleaving
    field away from its uniform value); only then are the layers built and compared (a false alarm costs a build)."""
    for v in cfg.to_dict().values():
        if isinstance(v, list) and len(v) == depth and len({repr(x) for x in v}) > 1:
            return True
    return any(_get(cfg, k) not in (None, uniform) for k, uniform in _INTERLEAVE.items())


def _signature(layer, layer_type) -> tuple:
    mods = tuple((n, type(m).__name__, tuple((a, repr(getattr(m, a))) for a in _ATTRS if hasattr(m, a)))
                 for n, m in layer.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    return mods, params, layer_type


def layer_kinds(cfg, depth: int) -> list[int] | None:
    """Each layer's kind (0, 1, ... in order of first appearance) when the model's decoder layers are not all alike,
    else None. Built on the meta device from the config at full depth, only when the config says they may differ."""
    if depth < 2 or not _maybe_mixed(cfg, depth):
        return None
    from .architectures import build_model, layer_stacks
    from ..quant.llama import silence_libraries
    import copy
    silence_libraries()
    c = copy.deepcopy(cfg)
    c.use_cache = False
    with torch.device("meta"):
        model, _ = build_model(c, "eager")
    stack = layer_stacks(model)[0]
    if len(stack) != depth:
        return None
    types = _get(cfg, "layer_types")
    sigs, kinds = {}, []
    for i, layer in enumerate(stack):
        s = _signature(layer, types[i] if isinstance(types, list) and len(types) == depth else None)
        kinds.append(sigs.setdefault(s, len(sigs)))
    return kinds if len(sigs) > 1 else None


BASE = 2


def kind_runs(kinds: list[int]) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]], dict[int, int]]:
    """(base run's layer indices, {kind: that kind's run}, {kind: how many more layers of it the model has}) for
    the module docstring's scheme. Indices are into the full model's layers."""
    L = len(kinds)
    last = kinds[-1]
    occ: dict[int, list[int]] = {}
    for i in range(BASE, L):
        occ.setdefault(kinds[i], []).append(i)
    others = [occ[k][0] for k in occ if k != last]                 # one of each other kind, in order
    base = (0, 1, *others, occ[last][0])
    # the model's layers beyond the base run: every layer from BASE on, less one of each kind the base run holds
    extra = {k: len(v) - 1 for k, v in occ.items()}
    runs = {}
    for k, n in extra.items():
        if n <= 0:
            continue
        more = occ[k][1]                                            # a second layer of that kind: not in the base
        runs[k] = (*base[:-1], more, base[-1])
    return base, runs, {k: n for k, n in extra.items() if n > 0}


def select_layers(model, cfg, idx: tuple[int, ...]) -> None:
    """Keep only the layers `idx` (indices into the model as built) of its repeated stack, in that order, renumber
    their `layer_idx` and cut the config's per-layer lists (`layer_types`) to match; in place."""
    from .architectures import layer_stacks
    stack = layer_stacks(model)[0]
    chosen = [stack[i] for i in idx]
    for new, layer in enumerate(chosen):
        for m in layer.modules():
            if hasattr(m, "layer_idx") and isinstance(m.layer_idx, int):
                m.layer_idx = new
    for name, m in model.named_modules():
        if m is stack:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], torch.nn.ModuleList(chosen))
            break
    for c in {id(cfg): cfg, id(model.config): model.config}.values():
        types = _get(c, "layer_types")
        if isinstance(types, list) and len(types) > max(idx):
            c.layer_types = [types[i] for i in idx]
        c.num_hidden_layers = len(idx)


def combine(base: dict, runs: dict[int, dict], counts: dict[int, int]) -> dict:
    """base + sum over kinds of counts[k] x (runs[k] - base), key by key (numbers or dicts of numbers)."""
    def one(key):
        b = base[key]
        if not isinstance(b, (dict, int, float)):
            return b                                   # words, not bytes (which attention path ran)
        if isinstance(b, dict):
            return {c: b[c] + sum(n * (runs[k][key][c] - b[c]) for k, n in counts.items()) for c in b}
        return b + sum(n * (runs[k][key] - b) for k, n in counts.items())
    return {key: one(key) for key in base}
