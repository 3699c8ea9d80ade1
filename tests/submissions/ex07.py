"""Plausible-wrong submissions for exercise 07 and the points each must lose, and correct
alternatives that must keep every point. Each is the solution with one mistake made in it."""

from __future__ import annotations

import re

from . import both, edit, solution_cells

ASSIGNMENT = "07_qlora"
_CELLS = solution_cells(ASSIGNMENT)
S1, S2, S3, S4 = "task7_1_nf4_quantize", "task7_2_double_quant", "task7_3_lora_linear", "task7_4_qlora_memory"
NF4, DQ, LORA, MEM = (_CELLS[k] for k in (S1, S2, S3, S4))


ALL1, ALL2, ALL3, ALL4 = both(S1), both(S2), both(S3), both(S4)


def _lose(task_ids, *lost):
    keep = [g for t in (ALL1, ALL2, ALL3, ALL4) for g in t if g not in task_ids]
    return {"must_lose": list(task_ids), "must_keep": keep}


WRONG = {
    # one absmax for the whole tensor instead of one per block
    "absmax_whole_tensor": {"replace": {S1: edit(NF4, "absmax = blocks.abs().amax(dim=1)",
                                                  "absmax = blocks.abs().max().expand(nb).clone()")},
                            **_lose(ALL1)},
    # the high and low nibbles swapped
    "nibbles_swapped": {"replace": {S1: edit(NF4, "packed = (codes[0::2] << 4) | codes[1::2]",
                                              "packed = (codes[1::2] << 4) | codes[0::2]")},
                        **_lose(ALL1)},
    # an evenly spaced int4 grid instead of NF4's normal-quantile levels
    "linear_int4_grid": {"replace": {S1: re.sub(r"NF4_LEVELS = torch\.tensor\(\[.*?\], dtype=torch\.float32\)",
                                                "NF4_LEVELS = torch.linspace(-1, 1, 16)", NF4, flags=re.S)},
                         **_lose(ALL1)},
    # ties go to the upper level (>= instead of >)
    "ties_upward": {"replace": {S1: edit(NF4, "(scaled[:, None] > mids)", "(scaled[:, None] >= mids)")},
                    **_lose(ALL1)},
    # the last, partial block is dropped
    "drops_partial_block": {"replace": {S1: edit(NF4, "nb = -(-n // blocksize)", "nb = n // blocksize or 1")},
                            **_lose(ALL1)},
    # divides by a zero absmax: a block of zeros becomes NaN codes
    "zero_block_nan": {"replace": {S1: edit(NF4, "absmax.clamp(min=1e-38)[:, None]", "absmax[:, None]")},
                       **_lose(["task7_1_nf4_quantize_hidden"])},
    # calls bitsandbytes instead of writing the quantization
    "nf4_library": {"replace": {S1: NF4 + '''

import bitsandbytes.functional as _bf


def nf4_quantize(x, blocksize=64):
    p, st = _bf.quantize_4bit(x, blocksize=blocksize, quant_type="nf4")
    return p.flatten(), st.absmax
'''}, **_lose(ALL1)},
    # double quantization without subtracting the mean
    "dq_no_offset": {"replace": {S2: edit(DQ, "y = absmax - offset", "y = absmax; offset = torch.tensor(0.0)")},
                     **_lose(ALL2)},
    # absmax2 as the largest centred value, max(y), not the largest magnitude max|y|: right only while the absmax
    # values are right-skewed (every run has left-skewed and symmetric inputs)
    "dq_max_not_absmax": {"replace": {S2: edit(DQ, "absmax2 = blocks.abs().amax(dim=1)",
                                               "absmax2 = blocks.amax(dim=1)")},
                          **_lose(["task7_2_double_quant_hidden"])},
    # bits per parameter forgetting to round the partial blocks up
    "bpp_floor": {"replace": {S2: edit(DQ, "blocks = -(-n // blocksize)", "blocks = n // blocksize")},
                  **_lose(["task7_2_double_quant_hidden"])},
    # scaling by alpha instead of alpha / r
    "lora_alpha_not_over_r": {"replace": {S3: edit(LORA, "self.scaling = alpha / r", "self.scaling = alpha")},
                              **_lose(ALL3)},
    # B initialised randomly: the model changes before training
    "lora_B_random": {"replace": {S3: edit(LORA, "self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))",
                                            "self.lora_B = nn.Parameter(torch.randn(base.out_features, r) * 0.01)")},
                      **_lose(ALL3)},
    # A drawn from a standard normal: about sqrt(3 d_in) times nn.Linear's scale (110x at 4096 inputs)
    "lora_A_standard_normal": {"replace": {S3: edit(LORA, "nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))",
                                                     "nn.init.normal_(self.lora_A)")},
                               **_lose(ALL3)},
    # kaiming_uniform_ without a=√5: U(-√(6/d_in), √(6/d_in)), √6 times too wide
    "lora_A_kaiming_default": {"replace": {S3: edit(LORA, "nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))",
                                                     "nn.init.kaiming_uniform_(self.lora_A)")},
                               **_lose(ALL3)},
    # A from a small normal: within nn.Linear's bound on few inputs, but neither its bound nor its spread on many
    "lora_A_small_normal": {"replace": {S3: edit(LORA, "nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))",
                                                  "nn.init.normal_(self.lora_A, std=0.01)")},
                            **_lose(["task7_3_lora_linear_hidden"])},
    # the base weight left trainable
    "lora_base_trainable": {"replace": {S3: edit(LORA, "            p.requires_grad_(False)",
                                                  "            pass")},
                            **_lose(ALL3)},
    # merge() leaves the adapter on: the update is applied twice
    # merge() swaps in a new Parameter instead of adding to the base weight in place
    "lora_merge_replaces_the_weight": {"replace": {S3: edit(
        LORA, "            self.base.weight += self.scaling * (self.lora_B @ self.lora_A)   # (d_out, d_in)",
        "            self.base.weight = nn.Parameter(self.base.weight + self.scaling * (self.lora_B @ self.lora_A),\n"
        "                                            requires_grad=False)")}, **_lose(ALL3)},
    "lora_merge_twice": {"replace": {S3: edit(LORA, "            self.merged = True", "            pass")},
                         **_lose(ALL3)},
    # 4 bits per weight only: the block scales are forgotten
    "qlora_no_scales": {"replace": {S4: edit(MEM, "return -(-n // 2) + nb + 4 * -(-nb // 256) + 4",
                                              "return -(-n // 2)")},
                        **_lose(ALL4)},
    # checkpointing without the recomputed layer
    "qlora_ckpt_no_recompute": {"replace": {S4: edit(MEM, "acts = L * 2 * BT * C + 8 * seq + outside + layer",
                                                      "acts = L * 2 * BT * C + 8 * seq + outside")},
                                **_lose(ALL4)},
    # checkpointing ignored: every layer keeps its full activations either way
    "qlora_ckpt_ignored": {"replace": {S4: edit(MEM, "    if checkpointing:\n", "    if False:\n")},
                           **_lose(ALL4)},
    # the loss's fp32 log-softmax over the vocabulary forgotten
    "qlora_no_fp32_logits": {"replace": {S4: edit(MEM, "outside = BT * (norm + 4 * V + 8)", "outside = BT * (norm + 8)")},
                             **_lose(ALL4)},
    # the previous, coarser accounting: bf16 norm outputs only, no fp32 norm inputs, layer 0 like the others
    "qlora_norms_bf16": {"replace": {S4: edit(MEM, "norm = 4 * C + 4", "norm = 2 * C")},
                         **_lose(ALL4)},
    # sdpa's float32 logsumexp (4 H bytes per token and layer) forgotten
    "qlora_no_logsumexp": {"replace": {S4: edit(MEM, " + 2 * C + 4 * H ", " + 2 * C ")}, **_lose(ALL4)},
    # the RoPE cos/sin tables forgotten
    "qlora_no_rope_tables": {"replace": {S4: edit(MEM, " + 2 * 2 * seq * d", "")}, **_lose(ALL4)},
    # k_proj and v_proj taken as (C, C): kv_heads ignored (right only without grouped-query attention)
    "qlora_kv_heads_ignored": {"replace": {S4: edit(MEM, 'kv = cfg["kv_heads"] * (C // H)', "kv = C")},
                               **_lose(ALL4)},
    # AdamW state in fp32 (8 bytes per parameter) and no step tensors
    "qlora_adam_fp32": {"replace": {S4: edit(MEM, '"optimizer": 4 * n_adapter + 4 * 14 * L',
                                              '"optimizer": 8 * n_adapter')},
                        **_lose(ALL4)},
}

# correct alternatives: every point kept
RIGHT = {
    # torch.bucketize against the midpoints (same tie rule), nibbles packed with arithmetic
    "nf4_bucketize": {"replace": {S1: edit(edit(NF4, "codes = (scaled[:, None] > mids).sum(dim=1).to(torch.uint8)",
                                                  "codes = torch.bucketize(scaled, mids).to(torch.uint8)"),
                                            "packed = (codes[0::2] << 4) | codes[1::2]",
                                            "packed = (codes[0::2].int() * 16 + codes[1::2].int()).to(torch.uint8)")}},
    # LoRA through two bias-free nn.Linear-like matmuls in the other order, F.dropout by hand
    "lora_functional": {"replace": {S3: edit(LORA, "return out + self.dropout(x) @ self.lora_A.T @ self.lora_B.T * "
                                                    "self.scaling",
                                              "h = F.linear(self.dropout(x), self.lora_A)\n"
                                              "        return out + self.scaling * F.linear(h, self.lora_B)")}},
    # the other evaluation order: the (d_out, d_in) update B @ A formed first, scaled, then applied to x
    "lora_merged_order": {"replace": {S3: edit(LORA, "return out + self.dropout(x) @ self.lora_A.T @ self.lora_B.T * "
                                                     "self.scaling",
                                               "return out + self.dropout(x) @ (self.scaling * self.lora_B @ "
                                               "self.lora_A).T")}},
    # absmax2 as max(max(y), -min(y)): the largest magnitude on either side, the same as max|y|
    "dq_two_sided_max": {"replace": {S2: edit(DQ, "absmax2 = blocks.abs().amax(dim=1)",
                                              "absmax2 = torch.maximum(blocks.amax(dim=1), -blocks.amin(dim=1))")}},
}
