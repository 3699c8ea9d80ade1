"""memlab.fit_search offers only plans the named libraries run, and tries what practitioners reach for first (the
Trainer's fused AdamW, QLoRA's non-quantized parts in 16 bits, the chunked loss) before stacking options."""

import memlab
from memlab.fitting.optimizers import trainer_default
from memlab.fitting.search import EXTRAS, FREE, OFFLOADABLE, _first_fitting, extras_of

# embeddings and head dominate this model (a 32000-word vocabulary on a 256-wide, 2-layer stack), as they do a
# Qwen2.5-14B on a T4: QLoRA's fp32 embeddings and head are what does not fit
WIDE = dict(model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
GiB = 2**30


def test_qlora_with_16_bit_non_quantized_parts_is_tried_before_stacking_options():
    kw = dict(method="qlora", checkpointing="full", seq=64, headroom=0.0)
    fp32 = memlab.fit(WIDE, 1, **kw)
    half = memlab.fit(WIDE, 1, qlora_rest="16bit", **kw)
    assert half.needed < fp32.needed
    gpu = (half.needed + fp32.needed) / 2 / GiB            # the 16-bit rest fits, the fp32 rest does not
    plans = memlab.fit_search(WIDE, gpu, seq=64, methods=("qlora",), headroom=0.0)
    assert plans and all(p.fits for p in plans)
    first = plans[0].plan
    assert first["qlora_rest"] == "16bit" and extras_of(first).startswith("16bit-rest"), first
    assert not first["step_in_backward"] and not first["paged"] and not first["activation_offload"], first
    for r in plans:       # the step in backward and paged state: never with ZeRO or gradient accumulation
        p = r.plan
        assert not (p["step_in_backward"] and (p["zero"] or p["micro_batch"] not in (None, p["batch"]))), p
        assert not (p["paged"] and p["zero"]), p


def test_only_plans_the_libraries_run_are_offered():
    """DeepSpeed's ZeRO-Offload runs its CPU Adam: an 8-bit (or any other) optimizer is never offered with it."""
    gpu = memlab.fit(WIDE, 1, seq=64, precision="mixed", zero=1, gpus=2, offload=True).needed / GiB * 1.1
    plans = memlab.fit_search(WIDE, gpu, seq=64, batch=2, gpus=(1, 2), methods=("full",), headroom=0.0, extras=False,
                              optimizers=("auto", "adamw8bit"), precision="mixed", limit=50)
    assert plans
    for r in plans:
        p = r.plan
        assert not (p["offload"] and p["optimizer"] not in OFFLOADABLE), p
    assert any(r.plan["optimizer"] == trainer_default() for r in plans)


def test_the_extras_go_from_free_to_dear_and_are_searched_by_bisection():
    assert EXTRAS[0] == {} and all(set(EXTRAS[i - 1].items()) < set(EXTRAS[i].items()) for i in range(1, 6))
    assert not any(x.get("step_in_backward") for x in EXTRAS[:FREE])
    tried = []

    def hits_of(x):
        tried.append(x)
        return ["hit"] if x >= 4 else []
    assert _first_fitting(list(range(6)), hits_of) == ["hit"] and tried[:2] == [0, 5] and len(tried) <= 4
    tried.clear()
    assert _first_fitting(list(range(6)), lambda x: tried.append(x) or []) == [] and tried == [0, 5]


def test_offload_charges_the_cpu_adamw_step_at_the_hosts_memory_bandwidth():
    """ZeRO-Offload runs AdamW on the CPU: 30 bytes per trainable parameter read and written in host memory (fp32
    gradient, master and moments read, master and moments and the 16-bit copy written), charged at the host's
    bandwidth on top of the PCIe traffic."""
    from memlab.fitting.search import HOST_BANDWIDTH, extra_seconds
    r = memlab.fit(WIDE, 1, seq=64, precision="mixed", zero=2, gpus=2, offload=True)
    assert r.cost["host_step_bytes"] == 30 * -(-r.trainable // 2)
    parts = extra_seconds(r, parts=True)
    assert parts["host_step"] == r.cost["host_step_bytes"] / HOST_BANDWIDTH > 0
    assert extra_seconds(r, parts=True, host_bandwidth=HOST_BANDWIDTH / 2)["host_step"] == 2 * parts["host_step"]
    assert "the CPU's AdamW step reads and writes" in str(r)
    assert memlab.fit(WIDE, 1, seq=64, precision="mixed", zero=2, gpus=2).cost["host_step_bytes"] == 0
