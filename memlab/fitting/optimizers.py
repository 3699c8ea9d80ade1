"""The optimizer as it is run, each with its own state and step scratch: `memlab.fit` makes the real optimizer (torch's
AdamW in its three implementations, SGD, transformers' Adafactor) on the virtual GPU's fake tensors, so its state
and every temporary of its step are what the same code allocates on a card; bitsandbytes' 8-bit AdamW, which cannot
run on fake tensors, is a stand-in holding exactly its state (`AdamW8bitStandIn`).

    name              what runs                                                  state / param   step scratch
    adamw             torch.optim.AdamW(foreach=True), torch's default on CUDA   2 x weight      1 x all weights
    adamw_fused       torch.optim.AdamW(fused=True): one kernel per group        2 x weight      none (a step tensor
                                                                                                 per parameter)
    adamw_forloop     torch.optim.AdamW(foreach=False), parameter by parameter   2 x weight      2 x the largest one
    sgd               torch.optim.SGD, no momentum (foreach)                     none            none
    sgd_momentum      torch.optim.SGD(momentum=0.9, foreach=True)                1 x weight      none
    adafactor         transformers.optimization.Adafactor as the HF Trainer      factored rows   the fp32 update
                      makes it (scale_parameter=False, relative_step=False,      and columns     and, for 16-bit
                      no first moment)                                                           weights, fp32
                                                                                                 copies
    adamw8bit         bitsandbytes.optim.AdamW8bit (block-wise 8-bit moments)    2 B + absmax    none (one fused
                                                                                                 CUDA kernel)
    paged_adamw8bit   bitsandbytes.optim.PagedAdamW8bit: the same state in CUDA  the same, paged none
                      unified memory (fit's paged=True)

The scratch column is what the measured step shows (tests/test_fit_optimizers.py checks every one byte for byte
against the real optimizer on real CPU tensors). "auto", fit's default, is what the Hugging Face Trainer picks on
the installed torch (`trainer_default`).
"""

from __future__ import annotations

import torch

from ..core.track import watch

__all__ = ["OPTIMIZERS", "OPTIMIZER_NAMES", "AdamW8bitStandIn", "make_optimizer", "trainer_default", "run_as"]

OPTIMIZER_NAMES = {
    "adamw": "AdamW (torch, foreach)", "adamw_fused": "AdamW (torch, fused)",
    "adamw_forloop": "AdamW (torch, for-loop)", "sgd": "SGD (no momentum)", "sgd_momentum": "SGD (momentum 0.9)",
    "adafactor": "Adafactor (transformers)", "adamw8bit": "AdamW 8-bit (bitsandbytes)",
    "paged_adamw8bit": "paged AdamW 8-bit (bitsandbytes)",
}
OPTIMIZERS = tuple(OPTIMIZER_NAMES)
LR = 1e-4


def trainer_default() -> str:
    """The optimizer the Hugging Face Trainer uses when none is named, on the installed torch: "adamw_torch_fused"
    from torch 2.8 on, "adamw_torch" (foreach on CUDA) before (transformers' TrainingArguments, field `optim`;
    tests/test_fit_optimizers.py reads it there). As fit names them: "adamw_fused" or "adamw"."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return "adamw_fused" if (major, minor) >= (2, 8) else "adamw"


def run_as(optimizer: str) -> str:
    """The optimizer whose run measures `optimizer`: the paged 8-bit AdamW holds the 8-bit one's state (fit counts
    it off the card afterwards)."""
    return "adamw8bit" if optimizer == "paged_adamw8bit" else optimizer


# ----------------------------------------------------------------------------- 8-bit AdamW, bytes only
class AdamW8bitStandIn(torch.optim.Optimizer):
    """Holds exactly the state `bitsandbytes.optim.AdamW8bit` holds (bitsandbytes 0.50,
    `Optimizer2State.init_state`), and updates nothing: for fake tensors, where bitsandbytes cannot run.

    Per parameter tensor of n elements (n >= min_8bit_size = 4096): state1, state2 uint8 (n each) and
    absmax1, absmax2 fp32 (ceil(n / 256) each), i.e. 2 n + 8 ceil(n / 256) bytes (Dettmers et al. 2022,
    "8-bit Optimizers via Block-wise Quantization"); smaller tensors keep fp32 state1/state2 (8 n bytes).
    The two 256-entry fp32 quantization maps (qmap1 "dynamic", qmap2 "udynamic") are made once and shared
    by every tensor. `step` is a Python int. The real update is one fused kernel per tensor: no scratch.
    """

    def __init__(self, params, lr: float = 1e-3, min_8bit_size: int = 4096, blocksize: int = 256):
        super().__init__(params, dict(lr=lr))
        self.min_8bit_size, self.blocksize, self._qmaps = min_8bit_size, blocksize, None

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    if p.numel() < self.min_8bit_size:
                        st["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        st["state2"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        if self._qmaps is None:
                            self._qmaps = (torch.zeros(256, device=p.device), torch.zeros(256, device=p.device))
                        blocks = -(-p.numel() // self.blocksize)
                        st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["qmap1"] = self._qmaps[0]
                        st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["qmap2"] = self._qmaps[1]
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                st["step"] += 1
        return None


class _MasterWeights:
    """precision="mixed": 16-bit weights and gradients in the model, an fp32 master copy that the optimizer
    updates (Micikevicius et al. 2018; DeepSpeed's bf16/fp16 optimizer). At the step the 16-bit gradients
    are copied to fp32 (all at once, as DeepSpeed's flat fp32 gradient partition), the inner optimizer
    steps the masters, and the masters are copied back into the 16-bit weights."""

    def __init__(self, params, make):
        self.params = list(params)
        self.masters = [torch.empty(p.shape, dtype=torch.float32) for p in self.params]
        watch(tensors=self.masters, category="optimizer")
        for m in self.masters:
            m.requires_grad_(True)
        self.inner = make(self.masters)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        self.inner.step()
        # the fp32 gradient copies are the step's scratch (the optimizer's hook labelled them gradients)
        watch(tensors=[m.grad for m in self.masters if m.grad is not None], category="temporaries")
        for m, p in zip(self.masters, self.params):
            m.grad = None
            p.data.copy_(m.data)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _adafactor(ps):
    from transformers.optimization import Adafactor
    # the Trainer's optim="adafactor": transformers' Adafactor with scale_parameter=False, relative_step=False
    # (transformers/trainer_optimizer.py, _get_adafactor) and the learning rate; beta1=None: no first moment
    return Adafactor(ps, lr=LR, scale_parameter=False, relative_step=False, warmup_init=False)


_MAKE = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
    "adamw_forloop": lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
    "adafactor": _adafactor,
    "adamw8bit": lambda ps: AdamW8bitStandIn(ps, lr=LR),
}


def make_optimizer(params, optimizer: str, precision: str):
    """The optimizer `optimizer` (a key of OPTIMIZER_NAMES; see the module docstring) over `params`, wrapped in fp32
    master weights for precision="mixed" (trainable 16-bit params only)."""
    make = _MAKE[run_as(optimizer)]
    params = list(params)
    if precision == "mixed" and any(p.dtype != torch.float32 for p in params):
        return _MasterWeights(params, make)
    return make(params)
