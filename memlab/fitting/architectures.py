"""The architectures `memlab.fit` runs, found from the config: which step a model takes (`model_task`), how it is
built (`build_model`), where its repeated layers are (`layer_stacks`, `cut_layers`) and what its inputs are
(`task_inputs`). The steps themselves, the optimizers and the virtual-GPU run are in `memlab/fitting/model.py`.

Which step, by the config (`model_task`):
  causal     decoder-only LMs (AutoModelForCausalLM; also BERT/BART with is_decoder=True): next-token loss
             on (batch, seq) tokens; inference: a prefill into a KV cache, the last token's logits
  seq-cls    encoder-only models (BERT, RoBERTa, DeBERTa-v2, DistilBERT ...: AutoModelForSequenceClassification):
             (batch, seq) tokens, one class label per sequence (num_labels from the config); inference: a
             no_grad forward
  seq2seq    encoder-decoder models (T5, BART, mBART ...: AutoModelForSeq2SeqLM): seq source tokens and seq
             target tokens (labels; the decoder input is the labels shifted right, as the model makes it);
             inference: the encoder over seq tokens and one decoder step with a cache
  image-cls  image classifiers (ViT ...: AutoModelForImageClassification): batch images of the config's
             image_size (seq is not used: the tokens are the patches), one label per image
Everything else fails in one line naming the architecture and these kinds. Mixture-of-experts layers run their
grouped matmuls on fake tensors in any dtype (`grouped_mm_any_dtype`).
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TASKS", "KINDS", "model_task", "model_depth", "build_model", "build_causal_lm", "layer_stacks",
           "decoder_layers", "cut_layers", "task_inputs", "unpacked_sequences", "grouped_mm_any_dtype"]


DECODER_DEPTH = ("num_decoder_layers", "decoder_layers")  # T5; BART, mBART, Marian, Pegasus


def _get(cfg, key):
    """cfg.key or None (transformers 5 configs raise AttributeError for keys they do not have)."""
    try:
        return getattr(cfg, key)
    except AttributeError:
        return None


def cut_layers(cfg, layers: int):
    """A copy of cfg with `layers` repeated layers (per-layer lists cut to match). An encoder-decoder's decoder
    keeps its difference in depth to the encoder (decoder = layers + Ld - Le), so that extending `layers` to the
    encoder's depth gives both stacks theirs; a decoder shallower by more than layers - 1 cannot be cut so."""
    c = copy.deepcopy(cfg)
    L = c.num_hidden_layers
    c.num_hidden_layers = layers
    for key in DECODER_DEPTH:
        d = _get(c, key)
        if isinstance(d, int) and key in c.__dict__:
            if layers + d - L < 1:
                raise ValueError(f"model: {c.model_type!r} has {L} encoder and {d} decoder layers; memlab.fit runs "
                                 f"{layers} encoder layers and needs the decoder at most {layers - 1} shallower")
            setattr(c, key, layers + d - L)
    if isinstance(_get(c, "layer_types"), list):
        c.layer_types = c.layer_types[:layers]
    c.use_cache = False
    return c


# which Auto class runs each kind of step (see the module docstring)
TASKS = {"causal": "AutoModelForCausalLM", "seq-cls": "AutoModelForSequenceClassification",
         "seq2seq": "AutoModelForSeq2SeqLM", "image-cls": "AutoModelForImageClassification"}
KINDS = ("decoder-only causal LMs (Llama, Mistral, Mixtral, Qwen, Gemma, Phi, GPT-2, Falcon; BERT or BART with "
         "is_decoder=True), encoder-only sequence classifiers (BERT, RoBERTa, DeBERTa-v2, DistilBERT), "
         "encoder-decoder seq2seq LMs (T5, BART, mBART) and image classifiers (ViT)")


def model_task(cfg) -> str:
    """"causal", "seq-cls", "seq2seq" or "image-cls": the step memlab.fit runs for this config (module docstring),
    from transformers' own Auto mappings: an explicit decoder (is_decoder) is a causal LM; an encoder-decoder with a
    seq2seq head runs seq2seq (another encoder-decoder - speech, multimodal - is not supported); a model with a
    masked-LM head and a classification head (an encoder) runs sequence classification; then causal LMs; then image
    classifiers. Anything else raises one ValueError line."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    t = type(cfg)

    def has(mapping):
        return t in getattr(auto, mapping)
    if _get(cfg, "is_decoder") and has("MODEL_FOR_CAUSAL_LM_MAPPING"):
        return "causal"
    if _get(cfg, "is_encoder_decoder"):         # a speech or multimodal encoder-decoder has no text seq2seq head
        if has("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING"):
            return "seq2seq"
    elif has("MODEL_FOR_MASKED_LM_MAPPING") and has("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING"):
        return "seq-cls"
    elif has("MODEL_FOR_CAUSAL_LM_MAPPING"):
        return "causal"
    elif has("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING"):
        return "image-cls"
    raise ValueError(f"model: {getattr(cfg, 'model_type', '?')!r} ({t.__name__}) is not a causal language model, an "
                     f"encoder classifier, a seq2seq LM or an image classifier in transformers "
                     f"{transformers.__version__}; memlab.fit runs {KINDS}")


def model_depth(cfg) -> int:
    """The number of repeated layers memlab.fit extends to (the encoder's for an encoder-decoder); an
    unsupported architecture fails here in one line (`model_task`)."""
    model_task(cfg)
    depth = _get(cfg, "num_hidden_layers")
    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"model: the {cfg.model_type!r} config gives no number of layers (num_hidden_layers)")
    return depth


def build_model(cfg, attention: str):
    """(model, task): the transformers Auto model for the config's task (`model_task`) with the model's own
    attention path: `attention` ("sdpa" or "eager"), or eager where the architecture has no sdpa path (Gemma-2,
    T5 in transformers 5). What cannot be built fails in one line naming the architecture."""
    import transformers
    task = model_task(cfg)
    auto = getattr(transformers, TASKS[task])
    kind = getattr(cfg, "model_type", "?")
    for impl in dict.fromkeys((attention, "eager")):
        cfg._attn_implementation = impl
        try:
            model = auto.from_config(cfg)
            model._memlab_attention = impl           # what runs: the asked path, or eager where there is no other
            return model, task
        except ValueError as e:
            if "attention implementation" in str(e) and impl != "eager":
                continue                     # no sdpa path for this architecture: its eager one
            raise ValueError(f"model: transformers could not build {kind!r} as {TASKS[task]} from this config: "
                             f"{str(e).splitlines()[0] if str(e) else e}") from None
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"model: transformers could not build {kind!r} as {TASKS[task]} from this config "
                             f"({type(e).__name__}: {e})") from None
    raise AssertionError("not reached")


def build_causal_lm(cfg, attention: str):
    """transformers' AutoModelForCausalLM for `cfg` (see `build_model`); a config of another kind fails in one line."""
    model, task = build_model(cfg, attention)
    if task != "causal":
        raise ValueError(f"model: {cfg.model_type!r} runs a {task} step, not a causal language model")
    return model


def layer_stacks(model) -> list:
    """The model's stacks of repeated layers, found generically: the outermost nn.ModuleLists of identical blocks
    (one class) whose length is a depth of the config (num_hidden_layers; an encoder-decoder's decoder depth),
    the largest block first. A decoder-only model has one, an encoder-decoder two."""
    cfg = model.config
    depths = {d for d in (_get(cfg, "num_hidden_layers"), *(_get(cfg, k) for k in DECODER_DEPTH)) if isinstance(d, int)}
    found, names = [], []
    for name, m in model.named_modules():
        if any(name.startswith(n + ".") for n in names):
            continue
        if isinstance(m, nn.ModuleList) and len(m) in depths and len({type(b) for b in m}) == 1 \
                and any(True for _ in m[0].parameters()):
            found.append(m)
            names.append(name)
    if not found:
        raise ValueError(f"model: no stack of {sorted(depths)} identical layers in {type(model).__name__} "
                         f"(memlab.fit needs the repeated layers as one nn.ModuleList, as transformers holds them)")
    return sorted(found, key=lambda st: -sum(p.numel() for p in st[0].parameters()))


def decoder_layers(model) -> nn.ModuleList:
    """The largest stack of repeated layers (`layer_stacks`)."""
    return layer_stacks(model)[0]


PEFT_TASK = {"causal": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM", "image-cls": None}
# a classifier's head is trained whole (peft's modules_to_save: "classifier" and "score" for SEQ_CLS, and the
# "classifier" of peft's image-classification LoRA guide), so its linears get no adapters: peft 0.21 refuses
# modules_to_save on a LoRA-wrapped head (DistilBERT's, DeBERTa-v2's "classifier" under "all-linear")
HEAD_MODULES = r"(.*\.)?(pre_classifier|classifier|score)(\..*)?"     # DistilBERT's pre_classifier: peft matches
#                                                        modules_to_save by suffix, so it is trained whole too


def _labels(cfg, n: int):
    """One label per example, as the model's loss reads them: class ids (n,) for single-label classification,
    (n,) floats for regression (num_labels = 1), (n, num_labels) floats for multi-label."""
    k, kind = getattr(cfg, "num_labels", 2), _get(cfg, "problem_type")
    if kind == "regression" or (kind is None and k == 1):
        return torch.zeros(n)
    if kind == "multi_label_classification":
        return torch.zeros(n, k)
    return torch.randint(0, k, (n,))


def task_inputs(model, n: int, seq: int, labels: bool = True, target_seq: int | None = None) -> dict:
    """The model's inputs for n examples: (n, seq) token ids (causal: labels = the tokens; seq-cls: a class per
    sequence; seq2seq: (n, target_seq or seq) target tokens), or for an image classifier (n, channels, size, size)
    pixels in the dtype of its patch embedding (seq is not used) and a class per image."""
    cfg = model.config
    task = getattr(model, "_memlab_task", "causal")
    if task == "image-cls":
        size = cfg.image_size if isinstance(cfg.image_size, (tuple, list)) else (cfg.image_size,) * 2
        conv = next((p.dtype for p in model.parameters() if p.dim() == 4), torch.float32)
        out = {"pixel_values": torch.zeros(n, getattr(cfg, "num_channels", 3), *size, dtype=conv)}
    else:
        out = {"input_ids": torch.randint(0, cfg.vocab_size, (n, seq))}
    if labels:
        out["labels"] = out["input_ids"] if task == "causal" else \
            torch.randint(0, cfg.vocab_size, (n, target_seq or seq)) if task == "seq2seq" else _labels(cfg, n)
    return out


@contextlib.contextmanager
def unpacked_sequences():
    """While the step runs: transformers' check for packed sequences (several sequences in one row, found from
    position_ids) answers "none", as it does for the full, unpadded rows `fit` runs - with the same temporaries.
    Without this, fake tensors look like a trace to transformers, which then assumes packing and builds a
    (B, 1, T, T) mask that the real run never builds. Likewise a padding mask of ones that a model makes itself
    (BART's decoder, T5) is read as "no padding" on fake tensors, as the real run reads it, so sdpa's is_causal
    (or no mask) is used as there. Masks a real run does build (sliding windows, models that always build one)
    are built as the model builds them."""
    import transformers.masking_utils as mu
    from torch._subclasses.fake_tensor import FakeTensor
    real = (mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa)

    def none_packed(position_ids):
        first = position_ids[:, :1] - 1
        (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        return None

    def unpadded(check):
        def run(padding_mask, *args, **kwargs):
            if isinstance(padding_mask, FakeTensor) or getattr(padding_mask, "is_meta", False):
                # all ones, as fit's batches are: the real check's temporaries, then its answer
                mu.fast_all(padding_mask)
                padding_mask = None
            return check(padding_mask, *args, **kwargs)
        return run
    mu.find_packed_sequence_indices = none_packed
    mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa = unpadded(real[1]), unpadded(real[2])
    try:
        yield
    finally:
        mu.find_packed_sequence_indices, mu._ignore_causal_mask_sdpa, mu._ignore_bidirectional_mask_sdpa = real


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- mixture-of-experts
# A mixture-of-experts layer in transformers 5 (Mixtral, Qwen3-MoE, ...) keeps its experts as two 3-D
# parameters, gate_up_proj (E, 2I, C) and down_proj (E, C, I), and on a GPU (compute capability >= 8.0) runs
# them with torch's grouped matmul (transformers.integrations.moe.grouped_mm_experts_forward): the T x k routed
# token copies sorted by expert, one aten._grouped_mm for gate_up and one for down, each output (T k, 2I) and
# (T k, C) - only the chosen experts' rows, never (T, E, ...). PyTorch's meta kernel for aten._grouped_mm (the
# shape function fake tensors use) accepts bf16 only, as the CUDA fast path; the kernels themselves accept fp32
# and fp16 too (the CPU kernel here; on CUDA a per-group matmul fallback into the same output). `fit` runs fp32
# (precision "fp32", "amp", QLoRA's fp32 experts) and fp16 plans, so under fake tensors any other dtype gets the
# output the meta kernel would make for bf16, in the input's dtype.
#
# LoRA on these experts (peft's target_modules="all-linear" targets gate_up_proj and down_proj as parameters,
# peft.tuners.lora.layer.ParamWrapper) does not run x A B beside the experts: for each forward it builds the
# adapted weights W + s B A of the whole expert stack (peft's _activate_lora with nn.utils.parametrize.cached)
# and the grouped matmul keeps them for its backward. Per layer that is 2 E (2I C + C I) bytes in 16-bit: for
# Mixtral-8x7B (E 8, C 4096, I 14336) 2.625 GiB per layer, 84 GiB over 32 layers, beside the tokens' own
# activations (tests/test_fit_families.py bounds both at 1 x 1024 tokens). That is what peft 0.21 on
# transformers 5 allocates (the tiny Mixtral's real CPU step equals fit to the byte); it is not a dense fallback.
def grouped_mm_any_dtype(model):
    """While the step runs on fake tensors: aten._grouped_mm of fp32 / fp16 inputs gets its output tensor (see the
    note above); real tensors and bf16 go to PyTorch's own kernels. A no-op for models without 3-D parameters."""
    if not any(p.dim() == 3 for p in model.parameters()):
        return _null()
    return _GroupedMMAnyDtype()


def _grouped_mm_out(a, b, offs, out_dtype):
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    return _create_grouped_mm_output_tensor(a, b, offs, out_dtype)


class _GroupedMMAnyDtype(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            from torch._subclasses.fake_tensor import FakeTensor
            if isinstance(args[0], FakeTensor) or args[0].is_meta:
                offs = args[2] if len(args) > 2 else kwargs.get("offs")
                out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
                return _grouped_mm_out(args[0], args[1], offs, out_dtype)
        return func(*args, **kwargs)
