"""Lesson 09, parallelism that shards activations: tensor and sequence parallelism (`tp`: a block written to be
split, the `parallelize_module` plan, bytes and traffic per rank), pipelines, ring attention and 3-D layouts
(`layout`: the bubble, micro-batches in flight, the merge step, links, a 70B layout per GPU), the functions
the ranks run (`runs`, also a script for torchrun), and torch.distributed.pipelining's other schedules
(`schedules`: GPipe re-materialised, interleaved 1F1B, zero bubble; a timeline played from a schedule's order).

`runs` and `schedules` are not imported here: they are what rank processes import (`memlab.parallel.runs`,
`memlab.parallel.schedules`)."""
from .layout import (LINKS, PUBLISHED_LAYOUTS, bubble_fraction, collective_seconds, in_flight_microbatches,
                     layout_bytes, link_bandwidth, merge_attention)
from .tp import (Block, block_param_counts, korthikanti_layer_bytes, kv_head_split, layer_activation_bytes,
                 tp_comm_per_layer, tp_param_bytes, tp_plan)

__all__ = ["Block", "tp_plan", "block_param_counts", "tp_param_bytes", "kv_head_split", "layer_activation_bytes",
           "korthikanti_layer_bytes", "tp_comm_per_layer", "bubble_fraction", "in_flight_microbatches",
           "merge_attention", "LINKS", "link_bandwidth", "collective_seconds", "layout_bytes", "PUBLISHED_LAYOUTS"]
