"""What `memlab.fit` answers (`FitResult`): the bytes by category and phase, the verdict against the card, the cost
of the plan, and the answer as memlab-fit prints it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..core.track import CATEGORIES, format_bytes
from .optimizers import OPTIMIZER_NAMES

__all__ = ["FitResult", "BORDERLINE"]

GiB = 2**30
BORDERLINE = 0.02      # a plan with less than 2% of the card to spare beyond the headroom is called borderline


# ----------------------------------------------------------------------------- the result
@dataclass
class FitResult:
    """What `fit` found. Bytes are per GPU (per rank with ZeRO)."""
    peak: int                        # bytes of live tensors at the step's peak (the allocator's max allocated)
    capacity: int                    # the GPU's total_memory, bytes
    usable: int                      # capacity * (1 - headroom)
    fits: bool                       # reserved + context <= usable
    by_category: dict[str, int]      # memlab.CATEGORIES at the peak
    by_phase: dict[str, int]         # phase -> its peak bytes ("idle" is the model as loaded)
    plan: dict                       # the options
    cost: dict                       # recompute_flops, offload_bytes, steps_per_batch, comm_bytes (per step)
    seconds: float                   # time to answer
    model: str = ""
    gpu: str = ""
    peak_phase: str = ""
    model_states: dict = field(default_factory=dict)   # parameters/gradients/optimizer per rank after the step
    n_params: int = 0
    trainable: int = 0
    reserved: int | None = None      # the least reserved memory the steady-state step runs in (None: peak)
    reserved_cached: int | None = None   # max reserved with memory to spare (None: reserved)
    context: int = 0                 # CUDA context + cuBLAS workspaces assumed, outside the tensors
    context_source: str = ""
    notes: list = field(default_factory=list)   # what ran otherwise than asked, said in the answer

    def __post_init__(self):
        if self.reserved is None:
            self.reserved = self.peak
        if self.reserved_cached is None:
            self.reserved_cached = self.reserved

    @property
    def needed(self) -> int:
        """reserved + context: the card's memory the step needs."""
        return self.reserved + self.context

    @property
    def headroom_bytes(self) -> int:
        """usable - (reserved + context) (negative: it does not fit)."""
        return self.usable - self.needed

    @property
    def borderline(self) -> bool:
        """Fits, but with less than BORDERLINE of the capacity to spare beyond the headroom: the allocator model and
        the context are estimates (benchmarks/fit.md), and a longer batch or another process takes more."""
        return self.fits and self.headroom_bytes < BORDERLINE * self.capacity

    @property
    def verdict(self) -> str:
        """"fits", "fits (borderline)" or "does not fit"."""
        return ("fits (borderline)" if self.borderline else "fits") if self.fits else "does not fit"

    def to_dict(self) -> dict:
        return {**asdict(self), "headroom_bytes": self.headroom_bytes}

    def __str__(self) -> str:
        p = self.plan
        verdict = self.verdict.upper()
        h = 1 - self.usable / self.capacity if self.capacity else 0
        lines = [f"{self.model} on {self.gpu}: {verdict}: needs {format_bytes(self.needed)} of "
                 f"{format_bytes(self.usable)} usable ({format_bytes(self.capacity)} x (1 - {h:.2f} headroom))",
                 f"  {p['mode']}, {p['method']}, {p['precision']}"
                 f"{', ' + OPTIMIZER_NAMES.get(p['optimizer'], p['optimizer']) + ', checkpointing ' + p['checkpointing'] if p['mode'] == 'train' else ''}"  # noqa: E501
                 f", batch {p['batch']}"
                 f"{' (micro-batch ' + str(p['micro_batch']) + ')' if p['micro_batch'] else ''} x seq {p['seq']}"
                 f"{' -> target ' + str(p['target_seq']) if p.get('target_seq') else ''}"
                 f"{', ZeRO-' + str(p['zero']) if p['zero'] else ''}"
                 f"{', ' + str(p['gpus']) + ' GPUs' if p['gpus'] > 1 else ''}"
                 f"{', optimizer offloaded to CPU' if p['offload'] else ''}"
                 f"{', non-quantized parts ' + p.get('qlora_rest', 'fp32') if p['method'] == 'qlora' else ''}"
                 f"{', chunked loss' if p.get('loss') == 'chunked' else ''}"
                 f"{', optimizer step in backward' if p.get('step_in_backward') else ''}"
                 f"{', activations offloaded' if p.get('activation_offload') else ''}"
                 f"{', paged optimizer state' if p.get('paged') else ''}; "
                 f"{self.n_params / 1e9:.2f}B parameters, {self.trainable / 1e6:.1f}M trainable",
                 f"  {'category':<12} {'at peak':>11}     {'phase':<9} {'peak':>11}"]
        phases = list(self.by_phase.items())
        for i, c in enumerate(CATEGORIES):
            right = f"     {phases[i][0]:<9} {format_bytes(phases[i][1]):>11}" if i < len(phases) else ""
            lines.append(f"  {c:<12} {format_bytes(self.by_category.get(c, 0)):>11}{right}")
        lines.append(f"  {'total':<12} {format_bytes(self.peak):>11}     (allocated, peak in '{self.peak_phase}')")
        lines.append(f"  + caching allocator {format_bytes(self.reserved - self.peak):>10} = reserved "
                     f"{format_bytes(self.reserved)} (it caches up to {format_bytes(self.reserved_cached)} when the "
                     f"card has room)")
        lines.append(f"  + CUDA context      {format_bytes(self.context):>10} = needs {format_bytes(self.needed)}"
                     f"{' (' + self.context_source + ')' if self.context_source else ''}")
        lines += [f"  note: {n}" for n in self.notes]
        sign = "spare" if self.fits else "short"
        lines.append(f"  headroom: {abs(self.headroom_bytes) / GiB:.2f} GiB {sign}; answered in {self.seconds:.1f} s")
        c = self.cost
        if p["mode"] == "train":
            lines.append(f"  extra cost per step: recompute {c['recompute_flops'] / 1e12:.2f} TFLOP, offload "
                         f"{format_bytes(c['offload_bytes'])} over PCIe, "
                         f"ZeRO/DP traffic {format_bytes(c['comm_bytes'])}"
                         f" per rank, {c['steps_per_batch']} micro-batch(es)"
                         + (f", QLoRA dequantization {format_bytes(c['dequant_bytes'])} of DRAM traffic"
                            if c.get("dequant_bytes") else "")
                         + (f", the CPU's AdamW step reads and writes {format_bytes(c['host_step_bytes'])} of host "
                            f"memory" if c.get("host_step_bytes") else ""))
        return "\n".join(lines)
