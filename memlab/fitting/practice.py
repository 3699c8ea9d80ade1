"""Two options practitioners turn on, as the virtual GPU runs them: activation offloading (torchtune's
enable_activation_offloading) and the chunked cross-entropy (torchtune's CEWithChunkedOutputLoss)."""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["offload_activations", "LOSS_CHUNKS", "chunked_causal_lm_loss"]


class offload_activations(torch.autograd.graph.saved_tensors_hooks):
    """Activation offloading (torchtune's enable_activation_offloading, its OffloadActivations; PyTorch's
    torch.autograd.graph.save_on_cpu) as the virtual GPU sees it: every tensor the forward saves for the backward
    goes to the host, so the card's copy is freed when nothing else holds it, and comes back onto the card when the
    backward needs it. As torchtune does, parameters (and views of them, such as a transposed weight) and tensors
    under 1 KiB stay where they are. The virtual GPU's fake tensors report device "cpu" (memlab.VirtualGPU), so the
    host copy here is a meta tensor, which nothing counts, and the tensor that comes back is a new one of the same
    shape: bytes only (on real tensors use torch.autograd.graph.save_on_cpu). info["offloaded_bytes"] adds up what
    went out, per save, as save_on_cpu copies each (an input saved by three projections goes out three times): the
    PCIe traffic is twice that per micro-batch. enabled=False: a no-op."""
    MIN_BYTES = 1024        # torchtune's min_offload_size

    def __init__(self, info: dict, enabled: bool = True):
        info.setdefault("offloaded_bytes", 0)

        def pack(t):
            if (not enabled or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
                    or t.numel() * t.element_size() < self.MIN_BYTES):
                return t
            info["offloaded_bytes"] += t.numel() * t.element_size()
            return (t.device, torch.empty_like(t, device="meta"))     # on the host: off the card's books

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return torch.empty_like(host, device=device)              # back on the card for the backward
        super().__init__(pack, unpack)


LOSS_CHUNKS = 8      # torchtune's CEWithChunkedOutputLoss default (num_output_chunks)


def chunked_causal_lm_loss(model, x, chunks: int = LOSS_CHUNKS):
    """Next-token cross-entropy of a causal LM with the output head applied chunk by chunk along the sequence, each
    chunk's logits upcast to fp32 on their own (torchtune's CEWithChunkedOutputLoss): no (B, T, V) logits tensor,
    fp32 or 16-bit, is ever whole. The mean over the B x (T - 1) predicted tokens, as HF's loss with labels=x."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    h = base.get_decoder()(input_ids=x).last_hidden_state[:, :-1]      # (B, T-1, C): positions that predict
    y = x[:, 1:]                                                        # (B, T-1): the next tokens
    head = base.get_output_embeddings()
    total = 0
    for hc, yc in zip(h.chunk(chunks, dim=1), y.chunk(chunks, dim=1)):
        logits = head(hc).float()                                       # (B, T/chunks, V) fp32: one chunk only
        total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1), yc.flatten(), reduction="sum")
    return total / y.numel()
