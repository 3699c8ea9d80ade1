"""Checks for exercise 07: NF4 and LoRA by hand (cases, runs, references and judges).

References are the libraries themselves, computed by the judge: bitsandbytes' `quantize_4bit` /
`dequantize_4bit` (NF4, CPU), its `quantize_blockwise` for the double quantization of the scales, peft's LoRA
layer (`get_peft_model` on a one-Linear module with the same weights copied in), and for the memory estimator
measurements: the model states of a real tiny Llama (bitsandbytes' quantized tensors, peft, memlab's tracker
around one AdamW step), and the activations that memlab's tracker attributes in one QLoRA training step of a
transformers Llama, on the CPU for tiny configs and on memlab.VirtualGPU for 7B- and 13B-shaped ones.

In the learner's process `run` makes the library shortcuts unusable for the learner's
own call: bitsandbytes' quantization functions and peft's entry points raise, and any
`bitsandbytes::` operator reaching the dispatcher is recorded and refused.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import dq_run, lora_run, nf4_run, qlora_run

TASKS = tasks(
    Task("task7_1_nf4_quantize", ("nf4_quantize", "nf4_dequantize"), "nf4_cases", nf4_run, "nf4_judge"),
    Task("task7_2_double_quant", ("double_quantize", "double_dequantize", "nf4_bits_per_param"), "dq_cases_list",
         dq_run, "dq_judge"),
    Task("task7_3_lora_linear", ("LoRALinear",), "lora_cases", lora_run, "lora_judge"),
    Task("task7_4_qlora_memory", ("qlora_memory",), "qlora_cases", qlora_run, "qlora_judge"),
)
