"""Plausible-wrong submissions for exercise 05 and the points each must lose, and correct
alternatives that must keep every point. Each is the solution with one mistake made in it."""

from __future__ import annotations

from . import edit, solution_cells

ASSIGNMENT = "05_efficient_attention"
_CELLS = solution_cells(ASSIGNMENT)
SOFTMAX, TILED, FLASH = (_CELLS[k] for k in ("task5_1_online_softmax", "task5_2_tiled_attention",
                                             "task5_3_flash_function"))


S1, S2, S3 = "task5_1_online_softmax", "task5_2_tiled_attention", "task5_3_flash_function"
ALL1, ALL2, ALL3 = [f"{S1}_visible", f"{S1}_hidden"], [f"{S2}_visible", f"{S2}_hidden"], [f"{S3}_visible",
                                                                                          f"{S3}_hidden"]

WRONG = {
    # the running sum is not rescaled when a later block raises the max
    "softmax_no_rescale": {"replace": {S1: edit(SOFTMAX, "l = l * torch.exp(m - safe) + ", "l = l + ")},
                           "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # the last, partial block is dropped
    "softmax_drops_partial_block": {
        "replace": {S1: edit(SOFTMAX, "range(0, x.shape[-1], block)", "range(0, x.shape[-1] - block + 1, block)")},
        "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # the row's max taken over the whole row up front: exact, but not read one block at a time
    "softmax_whole_row_max": {"replace": {S1: edit(SOFTMAX, "m_new = torch.maximum(m, xb.max(dim=-1).values)",
                                                   "m_new = x.max(dim=-1).values")},
                              "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # the result written over the caller's x
    "softmax_overwrites_its_input": {"replace": {S1: edit(SOFTMAX, "return torch.exp(x - m[..., None]) / l[..., None]",
                                                          "return x.sub_(m[..., None]).exp_().div_(l[..., None])")},
                                     "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # works in float32 whatever x's dtype: a float64 input comes back as float32, nine digits gone
    "softmax_in_float32_always": {"replace": {S1: edit(
        SOFTMAX, 'm = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)',
        'x = x.float()\n    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)')},
        "must_lose": [f"{S1}_hidden"], "must_keep": [f"{S1}_visible"] + ALL2 + ALL3},
    # the running max starts at 0, not -inf: rows far below zero underflow to 0 / 0
    "softmax_max_from_zero": {
        "replace": {S1: edit(SOFTMAX, 'm = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype)',
                             "m = torch.zeros(x.shape[:-1], dtype=x.dtype)")},
        "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # one max over all rows of the block instead of one per row: the lower rows underflow
    "softmax_one_max_for_all_rows": {
        "replace": {S1: edit(SOFTMAX, "torch.maximum(m, xb.max(dim=-1).values)", "torch.maximum(m, xb.max())")},
        "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # no guard for a row whose first block is all -inf: exp(-inf - (-inf)) is NaN
    "softmax_nan_on_masked_first_block": {
        "replace": {S1: edit(edit(SOFTMAX, '        safe = torch.where(m_new == float("-inf"), 0.0, m_new)\n', ""),
                             "l = l * torch.exp(m - safe) + torch.exp(xb - safe[..., None])",
                             "l = l * torch.exp(m - m_new) + torch.exp(xb - m_new[..., None])")},
        "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # calls the library softmax: right values, not the task
    "softmax_library": {"replace": {S1: "def online_softmax(x, block):\n    return torch.softmax(x, dim=-1)"},
                        "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # masks the future AFTER taking the tile's max: exp underflows when masked scores are large
    "mask_after_max": {"replace": {S2: edit(edit(TILED, "            if is_causal:\n                future",
                                                   "            m_new = torch.maximum(m, s.max(dim=-1).values)\n"
                                                   "            if is_causal:\n                future"),
                                             "            m_new = torch.maximum(m, s.max(dim=-1).values)\n"
                                             "            p =", "            p =")},
                       "must_lose": ALL2, "must_keep": ALL1},
    # query tiles stop before the last partial tile
    "tiled_drops_partial_tile": {"replace": {S2: edit(TILED, "range(0, tq, tile)", "range(0, tq - tile + 1, tile)")},
                                 "must_lose": ALL2, "must_keep": ALL1},
    # right values from the whole score matrix at once
    "tiled_full_matrix": {"replace": {S2: '''def tiled_attention(q, k, v, is_causal=False, tile=64):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    m = s.max(dim=-1, keepdim=True).values
    l = torch.exp(s - m).sum(dim=-1, keepdim=True)
    return torch.exp(s - m) / l @ v, (m + torch.log(l)).squeeze(-1)'''},
                          "must_lose": ALL2, "must_keep": ALL1},
    # tiles the queries only: each query tile's whole row of scores at once, a plain softmax over it (no key
    # tiles, no online softmax): O(T) per tile row, not the algorithm asked for
    "tiled_query_chunks_only": {"replace": {S2: '''def tiled_attention(q, k, v, is_causal=False, tile=64):
    *lead, tq, d = q.shape
    tk = k.shape[-2]
    outs, lses = [], []
    for i in range(0, tq, tile):
        s = q[..., i:i + tile, :] @ k.transpose(-1, -2) / math.sqrt(d)
        if is_causal:
            rows = torch.arange(i, i + s.shape[-2])[:, None]
            s = s.masked_fill(torch.arange(tk)[None, :] > rows, float("-inf"))
        m = s.max(dim=-1, keepdim=True).values
        p = torch.exp(s - m)
        l = p.sum(dim=-1, keepdim=True)
        outs.append(p @ v / l)
        lses.append((m + torch.log(l)).squeeze(-1))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)'''},
                                "must_lose": ALL2, "must_keep": ALL1},
    # saves the probabilities for backward instead of recomputing them
    "saves_probabilities": {"replace": {S3: edit(edit(FLASH, "ctx.save_for_backward(q, k, v, out, lse)",
                                                       "p = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) "
                                                       "- lse[..., None])\n        ctx.save_for_backward(q, k, v, out, "
                                                       "lse, p)"),
                                                  "q, k, v, out, lse = ctx.saved_tensors",
                                                  "q, k, v, out, lse, _p_all = ctx.saved_tensors")},
                            "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # a backward that builds the full score matrix
    "backward_full_matrix": {"replace": {S3: edit(FLASH, "        D = (dout * out).sum(dim=-1)",
                                                   "        _S = q @ k.transpose(-1, -2)\n"
                                                   "        D = (dout * out).sum(dim=-1)")},
                             "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # forgets the D term: dS = P * dP
    "backward_no_D": {"replace": {S3: edit(FLASH, "ds = p * (dp - D[..., i:i + tile, None])", "ds = p * dp")},
                      "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # forgets the causal mask in backward
    "backward_unmasked": {"replace": {S3: edit(FLASH, "                if ctx.is_causal:\n                    future",
                                                "                if False:\n                    future")},
                          "must_lose": [f"{S3}_hidden", f"{S3}_visible"], "must_keep": ALL1 + ALL2},
}

# correct alternatives: every point kept
RIGHT = {
    # FlashAttention with tile 32 in both passes (the visible case's T = 40 is then less than two tiles)
    "flash_tile_32": {"replace": {S3: edit(edit(FLASH, "is_causal=is_causal, tile=16)", "is_causal=is_causal, tile=32)"),
                                           "tile, tq, tk, d = 16,", "tile, tq, tk, d = 32,")}},
    # online softmax guarding the masked first block with nan_to_num instead of a safe max
    "softmax_nan_to_num": {"replace": {S1: edit(edit(SOFTMAX, '        safe = torch.where(m_new == float("-inf"), 0.0, m_new)\n', ""),
                                                "l = l * torch.exp(m - safe) + torch.exp(xb - safe[..., None])",
                                                "l = torch.nan_to_num(l * torch.exp(m - m_new)) + "
                                                "torch.nan_to_num(torch.exp(xb - m_new[..., None]))")}},
    # a different valid algorithm: per query tile, a first pass over the key tiles for the max, then the sum
    # and the output (scores computed twice, never all at once)
    "two_pass_tiles": {"replace": {S2: '''def tiled_attention(q, k, v, is_causal=False, tile=64):
    *lead, tq, d = q.shape
    tk = k.shape[-2]
    outs, lses = [], []
    for i in range(0, tq, tile):
        qi = q[..., i:i + tile, :] / math.sqrt(d)
        def scores(j):
            s = qi @ k[..., j:j + tile, :].transpose(-1, -2)
            if is_causal:
                rows = torch.arange(i, i + qi.shape[-2])[:, None]
                s = s.masked_fill(torch.arange(j, j + s.shape[-1])[None, :] > rows, float("-inf"))
            return s
        m = torch.stack([scores(j).max(dim=-1).values for j in range(0, tk, tile)]).max(dim=0).values
        l = sum(torch.exp(scores(j) - m[..., None]).sum(dim=-1) for j in range(0, tk, tile))
        acc = sum(torch.exp(scores(j) - m[..., None]) @ v[..., j:j + tile, :] for j in range(0, tk, tile))
        outs.append(acc / l[..., None])
        lses.append(m + torch.log(l))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)'''},
                       },
}
