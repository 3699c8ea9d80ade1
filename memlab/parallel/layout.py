"""Pipelines, rings and layouts: the pipeline bubble and the micro-batches a stage keeps, ring attention's merge
step, the links a collective crosses, and a 3-D layout (tensor x pipeline x data parallel, ZeRO-1 across the
data-parallel ranks) of a Llama-style model priced per GPU with the same formulas the small runs check.

Sources: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (Sec. 2.2.1: GPipe's and 1F1B's bubble is (p-1)/m of the ideal time; Sec. 2.2.2: interleaving v
chunks per GPU divides it by v); Huang et al. 2019, "GPipe" (Sec. 2.3: the same bubble as a share of the step,
O((K-1)/(M+K-1))); Korthikanti et al. 2022 (Sec. 4.2.3: with 1F1B the first stage keeps p micro-batches in
flight); Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context" (blocks of keys
and values passed around a ring); Rajbhandari et al. 2020 (ZeRO-1: the optimizer state split over the
data-parallel ranks); Megatron Core's distributed optimizer guide and Dubey et al. 2024 (Llama 3, Sec. 3.3.2,
"Numerical stability") for fp32 gradient accumulation.
"""

from __future__ import annotations

import torch

from ..core.gpus import gpu_spec
from ..core.validate import flag, one_of, pos_int
from .tp import layer_activation_bytes

__all__ = ["bubble_fraction", "in_flight_microbatches", "merge_attention", "LINKS", "link_bandwidth",
           "collective_seconds", "layout_bytes", "PUBLISHED_LAYOUTS"]

SCHEDULES = ("gpipe", "1f1b")
BUBBLE_OF = ("step", "ideal")


# ----------------------------------------------------------------------------- pipelines
def bubble_fraction(p: int, m: int, chunks: int = 1, of: str = "step") -> float:
    """The pipeline bubble of GPipe or 1F1B (chunks=1) or interleaved 1F1B (`chunks` model chunks per GPU) with
    p stages and m micro-batches, equal stages and free communication. Each stage idles (p-1)(t_f+t_b)/chunks
    per step while its useful work, the ideal time, is m(t_f+t_b) (Narayanan et al. 2021, Sec. 2.2.1-2.2.2).

    of="ideal": Narayanan et al.'s "bubble time fraction", idle time / ideal time = (p-1)/(chunks*m).
    of="step": the idle share of the whole step, idle / (ideal + idle) = (p-1)/(chunks*m + p-1), which is what
    a measured timeline shows and GPipe's form (Huang et al. 2019, Sec. 2.3: O((K-1)/(M+K-1)))."""
    pos_int("p", p)
    pos_int("m", m)
    pos_int("chunks", chunks)
    one_of("of", of, BUBBLE_OF)
    idle = (p - 1) / (chunks * m)                    # per unit of ideal time
    return idle if of == "ideal" else idle / (1 + idle)


def in_flight_microbatches(schedule: str, p: int, m: int, stage: int) -> int:
    """Most micro-batches whose activations stage `stage` (0 = first) holds at once: GPipe runs every forward
    before any backward, so all m; 1F1B starts backwards as soon as it can, so p - stage (at most m)."""
    one_of("schedule", schedule, SCHEDULES)
    pos_int("p", p)
    pos_int("m", m)
    pos_int("stage", stage, zero_ok=True)
    if stage >= p:
        raise ValueError(f"stage must be in [0, {p}) for p={p} stages, got {stage}")
    return m if schedule == "gpipe" else min(p - stage, m)


# ----------------------------------------------------------------------------- ring attention
def merge_attention(out_a, lse_a, out_b, lse_b):
    """Merge two attention results over disjoint sets of keys into the result over both: lesson 05's online
    softmax written with logsumexps. out_*: (..., T, d), lse_*: (..., T) the log of each row's sum of
    exp(scores); out_a=None starts the merge. lse = log(e^lse_a + e^lse_b);
    out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)."""
    for name, v in (("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
    if out_a is None:
        return out_b, lse_b
    if not isinstance(out_a, torch.Tensor) or not isinstance(lse_a, torch.Tensor):
        raise TypeError("out_a and lse_a must both be tensors (or out_a None to start)")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError(f"shapes must be out (..., T, d) and lse (..., T) on both sides, got {tuple(out_a.shape)}, "
                         f"{tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}")
    lse = torch.logaddexp(lse_a, lse_b)                                    # (..., T)
    out = out_a * (lse_a - lse).exp().unsqueeze(-1) + out_b * (lse_b - lse).exp().unsqueeze(-1)
    return out, lse


# ----------------------------------------------------------------------------- links
# bytes/s in ONE direction. NVLink and PCIe: half of the both-directions figure the data sheet prints
# (memlab.core.gpus, H100 SXM5 data sheet: NVLink 900 GB/s, PCIe Gen5 128 GB/s). InfiniBand NDR: 400 Gb/s
# per port (NVIDIA ConnectX-7 adapter data sheet: "up to 400Gb/s"), one port per GPU (a DGX H100 has eight
# single-port ConnectX-7 for its eight GPUs, NVIDIA DGX H100 user guide).
LINKS = {"NVLink (H100 SXM)": ("nvlink", "H100-80GB"), "PCIe Gen5 x16": ("pcie", "H100-80GB"),
         "InfiniBand NDR (400 Gb/s)": ("ib", None)}


def link_bandwidth(name: str) -> float:
    """One-direction bytes/s of a link in LINKS."""
    one_of("name", name, tuple(LINKS))
    kind, gpu = LINKS[name]
    if kind == "ib":
        return 400e9 / 8
    sheet = gpu_spec(gpu)
    return (sheet.nvlink_bandwidth if kind == "nvlink" else sheet.pcie_bandwidth) / 2


def collective_seconds(sent_bytes: float, link: str) -> float:
    """Lower bound on a ring collective's time: the bytes one rank sends / the link's one-direction bandwidth
    (no latency, no overlap with compute)."""
    if isinstance(sent_bytes, bool) or not isinstance(sent_bytes, (int, float)) or sent_bytes < 0:
        raise ValueError(f"sent_bytes must be a number >= 0, got {sent_bytes!r}")
    return sent_bytes / link_bandwidth(link)


# ----------------------------------------------------------------------------- a 3-D layout at full size
def _check_layout(shape, tp, pp, dp, seq, micro_batch, n_micro):
    need = ("n_layer", "n_head", "n_kv_head", "head_dim", "hidden", "ffn", "vocab")
    if not isinstance(shape, dict) or any(k not in shape for k in need):
        raise ValueError(f"shape must be a dict with keys {need} (e.g. memlab.attention.LLAMA_SHAPES[...])")
    for n, v in (("tp", tp), ("pp", pp), ("dp", dp), ("seq", seq), ("micro_batch", micro_batch),
                 ("n_micro", n_micro)):
        pos_int(n, v)
    if shape["n_layer"] % pp:
        raise ValueError(f"pp ({pp}) must divide n_layer ({shape['n_layer']})")
    if shape["n_kv_head"] % tp or shape["ffn"] % tp or seq % tp or shape["vocab"] % tp:
        raise ValueError(f"tp ({tp}) must divide n_kv_head, ffn, vocab and seq")


def layout_bytes(shape: dict, *, tp: int, pp: int, dp: int, seq: int, micro_batch: int = 1, n_micro: int = 8,
                 zero1: bool = True, recompute: bool = False, schedule: str = "1f1b", grad_bytes: int = 4) -> dict:
    """Per-GPU bytes of one training step of a Llama-style decoder (`memlab.attention.LLAMA_SHAPES` entry) on
    tp x pp x dp GPUs: bf16 weights; gradients accumulated in fp32 over the micro-batches (grad_bytes=4, as
    Megatron-LM's distributed optimizer keeps them, "bf16 parameters, fp32 gradients: 6 + 12/d bytes per
    parameter", and as Llama 3 was trained, Dubey et al. 2024, Sec. 3.3.2; grad_bytes=2: bf16 gradients);
    K = 12 bytes of fp32 Adam state (master weights and two moments) per parameter split over the dp ranks
    with ZeRO-1 (zero1=False: kept whole), Megatron's sequence parallelism, a fused attention kernel, 1F1B (or
    GPipe) over n_micro micro-batches of micro_batch x seq tokens.

    Returns, for the first and the last pipeline stage ("first", "last"), a dict of bytes: parameters,
    gradients, optimizer, activations (in-flight micro-batches x layers on the stage x
    `layer_activation_bytes`; recompute=True keeps only each layer's input, 2*s*b*h/t), logits (the last stage:
    fp32 (s, b, V/t) for the loss) and total; plus "n_params" and the stage's parameter count.
    Not counted: the CUDA context, allocator fragmentation, communication buckets, optimizer-step scratch."""
    _check_layout(shape, tp, pp, dp, seq, micro_batch, n_micro)
    flag("zero1", zero1)
    flag("recompute", recompute)
    one_of("schedule", schedule, SCHEDULES)
    one_of("grad_bytes", grad_bytes, (2, 4))
    L, H, KV, d, C, F, V = (shape[k] for k in ("n_layer", "n_head", "n_kv_head", "head_dim", "hidden", "ffn",
                                                "vocab"))
    proj = 2 * C * H * d + 2 * C * KV * d + 3 * C * F                       # one layer's matrices
    layer = proj // tp + 2 * C                                              # sharded matrices + 2 RMSNorms
    n_params = L * (proj + 2 * C) + 2 * V * C + C
    if recompute:
        act_layer = 2 * seq * micro_batch * C // tp                          # the layer's input, sequence-split
    else:
        act_layer = layer_activation_bytes(seq, micro_batch, C, H, f=F, kv_heads=KV, mlp="swiglu", t=tp,
                                           sequence_parallel=True, e=2, dropout=False, attn="flash")
    out = {"n_params": n_params}
    for name, stage in (("first", 0), ("last", pp - 1)):
        params = (L // pp) * layer + (V * C // tp if stage == 0 else 0) + (V * C // tp + C if stage == pp - 1 else 0)
        flight = in_flight_microbatches(schedule, pp, n_micro, stage)
        row = {"stage_params": params, "parameters": 2 * params, "gradients": grad_bytes * params,
               "optimizer": 12 * params // (dp if zero1 else 1),
               "activations": flight * (L // pp) * act_layer,
               "logits": 4 * seq * micro_batch * V // tp if stage == pp - 1 else 0}
        row["total"] = sum(v for k, v in row.items() if k != "stage_params")
        out[name] = row
    return out


# Published layouts, each with the exact place it is printed.
PUBLISHED_LAYOUTS = [
    {"model": "Llama 3 405B", "gpus": 8192, "tp": 8, "cp": 1, "pp": 16, "dp": 64, "seq": 8192,
     "source": "Dubey et al. 2024, The Llama 3 Herd of Models, Sec. 3.3.2, Table 4"},
    {"model": "Llama 3 405B", "gpus": 16384, "tp": 8, "cp": 1, "pp": 16, "dp": 128, "seq": 8192,
     "source": "Dubey et al. 2024, The Llama 3 Herd of Models, Sec. 3.3.2, Table 4"},
    {"model": "Llama 3 405B (long context)", "gpus": 16384, "tp": 8, "cp": 16, "pp": 16, "dp": 8, "seq": 131072,
     "source": "Dubey et al. 2024, The Llama 3 Herd of Models, Sec. 3.3.2, Table 4"},
    {"model": "GPT, 1T parameters", "gpus": 3072, "tp": 8, "cp": 1, "pp": 64, "dp": 6, "seq": None,
     "source": "Narayanan et al. 2021, Table 1 (last row; dp = GPUs / (tp x pp))"},
]

