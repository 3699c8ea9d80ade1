"""The independent reference of tests/test_fit.py and tests/test_fit_families.py: a model built the ordinary way (the
transformers Auto class a practitioner would pick, from_config, real CPU tensors, transformers' default attention,
peft's LoRA), two AdamW steps on the task's own batch, counted by memlab's MemoryTracker. memlab.fit must equal it
phase by phase. Nothing of memlab.fit's model code is used."""

from __future__ import annotations

import torch

import memlab
from memlab.core.track import MemoryTracker
from memlab.fitting.plan import load_config

PEFT_TASK = {"AutoModelForSequenceClassification": "SEQ_CLS", "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM",
             "AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForImageClassification": None}


def task_batch(cfg, auto: str, seq: int) -> dict:
    """The task's batch of one example, written out for each head (causal: labels are the tokens, no KV cache, as
    fit and Trainer recipes run it)."""
    if auto == "AutoModelForImageClassification":
        return {"pixel_values": torch.randn(1, cfg.num_channels, cfg.image_size, cfg.image_size).to(torch.bfloat16),
                "labels": torch.randint(0, cfg.num_labels, (1,))}
    x = torch.randint(0, cfg.vocab_size, (1, seq))
    if auto == "AutoModelForSequenceClassification":
        return {"input_ids": x, "labels": torch.randint(0, cfg.num_labels, (1,))}
    if auto == "AutoModelForSeq2SeqLM":
        return {"input_ids": x, "labels": torch.randint(0, cfg.vocab_size, (1, seq)), "use_cache": False}
    return {"input_ids": x, "labels": x, "use_cache": False}


def plain_step(cfg_dict: dict, seq: int, method: str = "full", checkpointing: bool = False,
               auto: str = "AutoModelForCausalLM", dtype: torch.dtype = torch.bfloat16, warm: bool = True):
    """The tracker of two plain AdamW steps (the second's forward and backward run beside the optimizer's state).
    The steps run once untracked first: some libraries make a small object on first use that then lives on (peft on
    GPT-2's Conv1D left 2,048 B in a cold process), which a training run pays once, not per step."""
    import transformers
    if warm:
        plain_step(cfg_dict, seq, method, checkpointing, auto, dtype, warm=False)
    cfg = load_config(cfg_dict)
    trk = MemoryTracker(device="cpu", round_to=512)
    with trk:
        with memlab.phase("load"):
            model = getattr(transformers, auto).from_config(cfg).to(dtype)
            if method == "lora":   # a classifier's head trained whole, no adapters on it (peft's LoRA guides)
                from peft import LoraConfig, get_peft_model
                head = dict(exclude_modules=r".*(classifier|score)(\.(dense|out_proj))?",
                            modules_to_save=["classifier"]) if "Classification" in auto else {}
                model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                         target_modules="all-linear", task_type=PEFT_TASK[auto],
                                                         **head))
            if checkpointing:
                base = model.get_base_model() if method == "lora" else model
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
            memlab.watch(model, opt)
        for _ in range(2):
            batch = task_batch(cfg, auto, seq)
            with memlab.phase("forward"):
                loss = model(**batch).loss
            with memlab.phase("backward"):
                loss.backward()
            del loss, batch
            with memlab.phase("step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    return trk
