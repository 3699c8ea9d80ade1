"""Lesson 10, memory by design. Static memory planning: tensor lifetimes of a real step (`lifetimes`, the
recorder) and offsets for them (`planner`, the idea: the live-bytes lower bound, greedy by size, first fit, the
brute-force optimum, validation), what TorchInductor's generated code allocates (`inductor`); data layout and
the copies a layout change costs (`layout`); memory-aware architectures (`architectures`: MobileNet, VGG-16,
convolution costs; `attention_variants`: local, linear and low-rank attention); top-k compression of saved
activations (`compress`); batch size as a Pareto frontier and lazy allocation (`budget`).

Importing it imports only torch: torch._inductor loads inside `inductor_code`, the profiler inside
`profiled_allocations`."""
from .architectures import (MOBILENET_V1, SeparableBlock, StandardBlock, conv2d_cost, conv_bn_relu, mobilenet_v1,
                            param_count, scaled_channels, vgg16)
from .attention_variants import (KINDS, ToyAttentionModel, linear_attention, local_attention, lowrank_attention,
                                 reversal_batch)
from .budget import noise_scale, pareto_front, resident_bytes, steps_and_samples
from .compress import TopK, TopKSavedActivations, topk_bytes, topk_pack, topk_unpack
from .inductor import WrapperBuffers, inductor_code, wrapper_buffers
from .layout import Allocations, layout_report, profiled_allocations
from .lifetimes import Trace, lifetimes_from_events, record_step, round_lifetimes, sub_trace
from .planner import (Lifetime, arena_size, as_lifetimes, check_plan, conflicts, first_fit, greedy_by_size,
                      live_bytes_curve, live_bytes_peak, optimal_offsets, plan_conflicts, plan_text)

__all__ = ["Lifetime", "Trace", "lifetimes_from_events", "record_step", "round_lifetimes", "sub_trace",
           "as_lifetimes", "conflicts", "live_bytes_curve", "live_bytes_peak", "greedy_by_size", "first_fit",
           "optimal_offsets", "arena_size", "plan_conflicts", "check_plan", "plan_text",
           "WrapperBuffers", "wrapper_buffers", "inductor_code", "Allocations", "layout_report",
           "profiled_allocations",
           "MOBILENET_V1", "SeparableBlock", "StandardBlock", "conv_bn_relu", "mobilenet_v1", "vgg16", "param_count",
           "conv2d_cost", "scaled_channels",
           "KINDS", "ToyAttentionModel", "local_attention", "linear_attention", "lowrank_attention",
           "reversal_batch",
           "TopK", "TopKSavedActivations", "topk_bytes", "topk_pack", "topk_unpack",
           "noise_scale", "pareto_front", "resident_bytes", "steps_and_samples"]
