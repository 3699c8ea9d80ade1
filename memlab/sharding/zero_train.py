"""Lesson 06's training script: one small GPT trained data-parallel with PyTorch DDP, DeepSpeed
ZeRO (stages 0-3, optionally with the optimizer offloaded) or FSDP2, measured on every rank.

The same functions run three ways, unchanged:
  * from a notebook or a test, on CPU ranks (gloo):
        memlab.sharding.RankGroup(4).run(memlab.sharding.zero_train.deepspeed_run, 2)
  * on a multi-GPU machine (nccl, one GPU per rank):
        torchrun --nproc_per_node 4 memlab/sharding/zero_train.py --framework deepspeed --stage 3
  * or with DeepSpeed's launcher:
        deepspeed --num_gpus 4 memlab/sharding/zero_train.py --framework deepspeed --stage 3
Run as a script, every rank prints one line of JSON with what it measured. Without GPUs both
launchers run it on CPU ranks with gloo (for `deepspeed`, set DS_ACCELERATOR=cpu).

What a run measures (on its own rank), for the last of `steps` training steps (the first one
creates the optimizer state): the live bytes by category when autograd's backward pass ends
("end_of_backward": parameters, gradients and optimizer state coexist), just before the
optimizer step (after the framework's own gradient reduction) and after it, the peak of the step,
the bytes of every collective (memlab.sharding.CommCounter) and, with offload, the bytes copied
between device and host. Everything comes back as plain data.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from memlab.sharding.comm import CommCounter
from memlab.core.models import GPT, GPTConfig
from memlab.core.track import CATEGORIES, phase, watch
from memlab.core.validate import flag, int_at_least, one_of, pos_int
from memlab.sharding.zero import HostLinkCounter, ShardAwareTracker, follow_storage_resizes, label_deepspeed
from memlab.sharding.zero import label as label_as

__all__ = ["model_config", "ds_config", "quiet_deepspeed", "ddp_run", "deepspeed_run", "fsdp2_run",
           "hf_trainer_run", "main", "hsdp_run"]

BATCH, SEQ = 2, 64           # per rank: 2 sequences of 64 tokens


def model_config(**kw) -> GPTConfig:
    """The lesson's model: memlab's tiny GPT with an untied head (867,072 parameters)."""
    return GPTConfig.tiny(**{"tie_weights": False, "block_size": SEQ, **kw})


def ds_config(stage: int, *, offload: bool = False, bucket: int = 2**17, micro_batch: int = BATCH,
              textbook_zero3: bool = True, zero_overrides: dict | None = None) -> dict:
    """A DeepSpeed config (the JSON file's content) for ZeRO `stage` with bf16 and torch's AdamW.

    bucket: elements per reduce / all-gather bucket. DeepSpeed's default is 5e8 elements, a
      1 GB bf16 buffer per rank whatever the model's size; 2**17 suits a tiny model.
    offload: keep the fp32 master weights, Adam's moments and the step on the host (ZeRO-Offload).
    textbook_zero3: shard every parameter and free it right after use (stage 3). DeepSpeed's defaults
      keep parameters under 1e5 elements whole on every rank (param_persistence_threshold) and keep
      a gathered parameter that will be reused soon (max_reuse_distance): for a tiny model, all of them.
    zero_overrides: more "zero_optimization" keys, e.g. {"use_multi_rank_bucket_allreduce": False}.
    """
    one_of("stage", stage, (0, 1, 2, 3), what="0, 1, 2 or 3")
    pos_int("bucket", bucket, what="a positive number of elements")
    zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=bucket)
        if textbook_zero3:
            zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    zero.update(zero_overrides or {})
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _device().type == "cuda"}
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if offload:
        cfg["zero_force_ds_cpu_optimizer"] = False     # torch's AdamW on the host (DeepSpeedCPUAdam needs a C++ build)
    return cfg


def quiet_deepspeed():
    """Import DeepSpeed for this rank without its noise and without a C++ build.

    DS_ACCELERATOR=cpu (set by memlab.sharding on gloo) picks DeepSpeed's CPU accelerator; its
    communication backend would otherwise compile a shared-memory all-reduce kernel (used only by
    inference) with the system compiler the first time it starts: we mark that kernel unavailable
    in the table DeepSpeed consults. INFO logging and torch.distributed's deprecation warnings off.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__dict__.setdefault("__compatible_ops__", {"deepspeed_shm_comm": False})
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="deepspeed")
    return deepspeed


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _batch(device, step):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)     # each rank its own data
    idx = torch.randint(0, model_config().vocab_size, (BATCH, SEQ), generator=g)
    return idx.to(device)


def _loop(framework, stage, build, steps, host_tensors=None) -> dict:
    """Build under a tracker, train `steps` steps, measure the last. `build(device)` returns
    (forward(x) -> loss, backward(loss), step(), label(), buffers() -> dict or None, n_params);
    label() tells the tracker the roles of the framework's tensors, after every phase."""
    int_at_least("steps", steps, 2, what="an int >= 2 (the first step creates the optimizer state)")
    device = _device()
    tracker = ShardAwareTracker(device=device.type, timeline=False)
    out = {"framework": framework, "stage": stage, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
           "device": str(device)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracker)
        stack.enter_context(follow_storage_resizes())
        forward, backward, step, label, buffers, n_params = build(device)
        label()
        for i in range(steps):
            last = i == steps - 1
            x = _batch(device, i)
            if last:
                tracker.reset_peak()
                comm = stack.enter_context(CommCounter())
                link = stack.enter_context(HostLinkCounter(host_tensors())) if host_tensors else None
                t0, c0 = time.perf_counter(), time.process_time()
            marks, snap = ([len(comm.log)], []) if last else (None, None)
            with phase("forward"):
                loss = forward(x)
            with phase("backward"):
                if last:
                    marks.append(len(comm.log))
                    # what is live when autograd's backward ends, before any post-backward reduction of the
                    # framework; categorised at the end, when every storage has its final role
                    def at_backward_end(grad):
                        torch.autograd.Variable._execution_engine.queue_callback(
                            lambda: snap.extend((b, b.nbytes) for b in tracker._blocks.values()))
                        return grad
                    loss.register_hook(at_backward_end)
                backward(loss)
            label()
            if last:
                gc.collect()            # buffers a framework dropped in a reference cycle: gone now, not at GC's whim
                out["before_step"] = tracker.breakdown()
                out["buffers"] = buffers()
            with phase("step"):
                if last:
                    marks.append(len(comm.log))
                step()
            label()
            if last:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                out["step_seconds"] = time.perf_counter() - t0          # wall time of the measured step
                out["step_cpu_seconds"] = time.process_time() - c0      # this rank's CPU time in it
                out["loss"] = float(loss.detach())
        eob = dict.fromkeys(CATEGORIES, 0)
        for blk, nbytes in snap:
            eob[CATEGORIES[blk.cat]] += nbytes
        out.update(n_params=n_params, end_of_backward=eob, after_step=tracker.breakdown(), peak=tracker.peak,
                   peak_breakdown=tracker.peak_breakdown, peak_phase=tracker.peak_phase,
                   phase_peaks=tracker.phase_peaks, comm=comm.as_dict(), comm_by_phase=_by_phase(comm.log, marks),
                   host_link={"to_host": link.to_host, "to_device": link.to_device} if host_tensors else None)
    return out


def _by_phase(log, marks):
    """{phase: {collective: payload bytes}} from the counter's log and the positions where phases began."""
    out = {}
    bounds = list(marks) + [len(log)]
    for name, a, b in zip(("forward", "backward", "step"), bounds[:-1], bounds[1:]):
        d = out.setdefault(name, {})
        for coll, nbytes in log[a:b]:
            d[coll] = d.get(coll, 0) + nbytes
    return out


# ----------------------------------------------------------------------------- the three frameworks
def ddp_run(steps: int = 2, gradient_as_bucket_view: bool = False) -> dict:
    """Plain data parallelism: torch DDP, fp32 weights, AdamW. Every rank holds everything."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build(device):
        torch.manual_seed(0)
        model = GPT(model_config()).to(device)
        ddp = DDP(model, gradient_as_bucket_view=gradient_as_bucket_view)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        watch(model, opt)

        def label():
            label_as([p.grad for p in model.parameters() if p.grad is not None], "gradients")
        return (lambda x: ddp(x, x), lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()),
                label, lambda: None, model.num_params())
    return _loop("ddp", 0, build, steps)


def deepspeed_run(stage: int, steps: int = 2, offload: bool = False, textbook_zero3: bool = True,
                  bucket: int = 2**17, zero_overrides: dict | None = None) -> dict:
    """DeepSpeed ZeRO `stage` (0 = DeepSpeed's bf16 data parallel) with the config of `ds_config`."""
    deepspeed = quiet_deepspeed()
    config = ds_config(stage, offload=offload, bucket=bucket, textbook_zero3=textbook_zero3,
                       zero_overrides=zero_overrides)
    box = {}

    def build(device):
        torch.manual_seed(0)
        model = GPT(model_config())
        n = model.num_params()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        box["engine"] = engine

        box["buffers"] = label_deepspeed(engine, hooks=True)

        def label():
            box["buffers"] = label_deepspeed(engine)
        return (lambda x: engine(x, x), engine.backward, engine.step, label, lambda: box["buffers"], n)

    def host_tensors():                                  # what ZeRO-Offload keeps on the host
        opt = box["engine"].optimizer
        ts = list(opt.single_partition_of_fp32_groups)
        ts += [g.grad for g in opt.single_partition_of_fp32_groups if g.grad is not None]
        ts += list(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", []))
        ts += [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return ts
    out = _loop("deepspeed", stage, build, steps, host_tensors if offload and stage in (1, 2) else None)
    if offload and stage in (1, 2):                       # bytes of the buffers kept on the host
        out["host_bytes"] = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                                 for t in host_tensors()}.values())
    out["offload"] = offload
    out["textbook_zero3"] = textbook_zero3
    box["engine"].destroy()
    return out


def fsdp2_run(steps: int = 2, reshard_after_forward: bool = True, reduce_dtype: str = "float32") -> dict:
    """PyTorch FSDP2: `fully_shard` on every block and on the root, bf16 compute
    (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=...)), AdamW on the fp32 shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    one_of("reduce_dtype", reduce_dtype, ("float32", "bfloat16"), what="'float32' or 'bfloat16'")

    def build(device):
        torch.manual_seed(0)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = GPT(model_config()).to(device)
        n = model.num_params()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def label():                                    # the shards (DTensors) of each role
            label_as(list(model.parameters()), "parameters")
            label_as([p.grad for p in model.parameters() if p.grad is not None], "gradients")
            label_as([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
                     "optimizer")
        return (lambda x: model(x, x), lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()),
                label, lambda: None, n)
    out = _loop("fsdp2", 3, build, steps)
    out.update(reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype)
    return out


def hf_trainer_run(stage: int = 2, steps: int = 2) -> dict:
    """Hugging Face Trainer with `TrainingArguments(deepspeed=<config dict>)` on a tiny Llama
    (random weights, built from a config). The "auto" values are filled in from the Trainer's
    arguments. Returns the loss, the stage DeepSpeed ran and this rank's ZeRO buffers."""
    quiet_deepspeed()
    import transformers
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments
    from memlab.core.models import tiny_llama_config
    transformers.logging.set_verbosity_error()
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "bf16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2**17, "allgather_bucket_size": 2**17,
                                    "stage3_prefetch_bucket_size": 2**17}}

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    n_params = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "memlab-hf"),
                             per_device_train_batch_size=2, max_steps=steps, learning_rate=1e-3, bf16=True,
                             deepspeed=config, use_cpu=_device().type == "cpu", report_to=[],
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    result = trainer.train()
    engine = trainer.model_wrapped
    from memlab.sharding.zero import deepspeed_buffers
    bufs = deepspeed_buffers(engine.optimizer, next(engine.module.parameters()).device.type)
    return {"loss": result.training_loss, "stage": engine.zero_optimization_stage(),
            "n_params": n_params,
            "optimizer": type(engine.optimizer).__name__, "world_size": dist.get_world_size(),
            "buffers": {k: {"bytes": v["bytes"], "role": v["role"]} for k, v in bufs.items()}}


# ----------------------------------------------------------------------------- as a script
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=("ddp", "deepspeed", "fsdp2"), default="deepspeed")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer state and step on the host")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-reshard", action="store_true", help="FSDP2: keep parameters gathered after the forward")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", args.local_rank or 0)))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if args.framework == "ddp":
        out = ddp_run(args.steps)
    elif args.framework == "fsdp2":
        out = fsdp2_run(args.steps, reshard_after_forward=not args.no_reshard)
    else:
        out = deepspeed_run(args.stage, args.steps, offload=args.offload)
    # one write per line: print() writes the text and the newline separately, and two ranks' lines can interleave
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()


# ----------------------------------------------------------------------------- hybrid sharding
def hsdp_run(replicate: int = 2, steps: int = 2, reshard_after_forward: bool = True,
             reduce_dtype: str = "float32") -> dict:
    """FSDP2 with hybrid sharding (HSDP; FSDP1's ShardingStrategy.HYBRID_SHARD): a 2-D DeviceMesh
    (replicate, shard) of shape (replicate, world_size // replicate). Each parameter is sharded over the
    ranks of its "shard" group and the shard is replicated over the "replicate" group: per step the
    gradients are reduce-scattered inside the shard group, then each gradient shard is all-reduced across
    the replicas. Otherwise as `fsdp2_run` (every block and the root, bf16 compute, AdamW on the shards).
    Adds to the result the mesh's shape and this rank's two groups ("replicate_group", "shard_group": global ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    pos_int("replicate", replicate)
    flag("reshard_after_forward", reshard_after_forward)
    one_of("reduce_dtype", reduce_dtype, ("float32", "bfloat16"), what="'float32' or 'bfloat16'")
    world = dist.get_world_size()
    if world % replicate:
        raise ValueError(f"replicate must divide the world size {world}, got {replicate}")
    shape = (replicate, world // replicate)
    groups = {}

    def build(device):
        torch.manual_seed(0)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        groups.update({f"{d}_group": dist.get_process_group_ranks(mesh.get_group(d)) for d in ("replicate", "shard")})
        model = GPT(model_config()).to(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
        for module in (*model.blocks, model):           # bottom-up, as fully_shard asks
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def label():
            label_as(list(model.parameters()), "parameters")
            label_as([p.grad for p in model.parameters() if p.grad is not None], "gradients")
            label_as([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
                     "optimizer")
        return (lambda x: model(x, x), lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()),
                label, lambda: None, model.num_params())
    out = _loop("hsdp", 3, build, steps)
    out.update(mesh=list(shape), reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype, **groups)
    return out
