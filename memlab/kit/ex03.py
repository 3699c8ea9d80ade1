"""What exercise 03's notebook (a loss scaler and an AMP step) takes from the kit: the driver that trains with
any loss scaler the way torch.amp.GradScaler is used, and the visible plan it is shown on.

- `drive_scaler(scaler, plan)` trains a plan's MLP with fp16 autocast, inf/NaN injected into chosen
  gradients and explicit unscale_ at chosen steps, and summarises what the scaler did as plain data
  (the notebook runs it on torch.amp.GradScaler and on the learner's DynamicLossScaler side by side).
- `VISIBLE_PLAN`: the plan of the visible check of task3_1; `make_plan` builds a plan (plain data).
"""

from __future__ import annotations

import torch

from ..core.models import MLP

__all__ = ["VISIBLE_PLAN", "make_plan", "plan_inputs", "param_groups", "drive_scaler", "summary"]

_INJECT = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def make_plan(seed, *, dims=(32, 64, 2, 10), batch=16, steps=16, x_scale=1.0, init_scale=2.0 ** 22,
              growth_factor=2.0, backoff_factor=0.5, growth_interval=3, inject=(), explicit=(), groups=1):
    return {"kind": "plan", "groups": groups, "seed": seed, "dims": list(dims), "batch": batch, "steps": steps,
            "x_scale": x_scale,
            "init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
            "growth_interval": growth_interval, "inject": [list(i) for i in inject], "explicit": sorted(explicit)}


VISIBLE_PLAN = make_plan(3, inject=[(7, "inf", 0, 5)], explicit=(10, 12))


def plan_inputs(plan):
    """(model, optimizer, batches) of a plan, rebuilt identically on both sides."""
    torch.manual_seed(plan["seed"])
    model = MLP(*plan["dims"])
    opt = torch.optim.SGD(param_groups(model, plan.get("groups", 1)), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(plan["seed"])
    batches = [(torch.randn(plan["batch"], plan["dims"][0], generator=g) * plan["x_scale"],
                torch.randint(0, plan["dims"][3], (plan["batch"],), generator=g)) for _ in range(plan["steps"])]
    return model, opt, batches


def param_groups(model, groups: int):
    """The model's parameters split into `groups` contiguous parameter groups, each with its own learning rate."""
    params = list(model.parameters())
    if groups <= 1:
        return params
    cut = [round(i * len(params) / groups) for i in range(groups + 1)]
    return [{"params": params[a:b], "lr": 0.05 / (1 + i)} for i, (a, b) in enumerate(zip(cut, cut[1:]))]


def summary(tensors, seed: int) -> list[list[float]]:
    """[norm, projection on a fixed random direction] of each tensor, in float64."""
    out = []
    for i, t in enumerate(tensors):
        d = t.detach().double().flatten()
        v = torch.randn(d.numel(), generator=torch.Generator().manual_seed(seed * 1009 + i), dtype=torch.float64)
        out.append([d.norm().item(), (d @ v).item()])
    return out


def drive_scaler(scaler, plan) -> dict:
    """Train a plan's MLP with fp16 autocast, SGD + momentum and `scaler`; inf/NaN injected into chosen
    gradients, unscale_ (and a clip that never bites) at chosen steps. Plain data of what happened."""
    model, opt, batches = plan_inputs(plan)
    params = list(model.parameters())
    calls = []
    hook = opt.register_step_pre_hook(lambda *args: calls.append(1))
    inject = {s: (v, pi, fi) for s, v, pi, fi in plan["inject"]}
    steps = []
    try:
        for i, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, y)                                 # fp32 loss from an fp16 forward
            used = float(scaler.get_scale())
            scaler.scale(loss).backward()
            if i in inject:
                value, pi, fi = inject[i]
                with torch.no_grad():
                    params[pi].grad.view(-1)[fi % params[pi].numel()] = _INJECT[value]
            explicit = None
            if i in plan["explicit"]:
                scaler.unscale_(opt)
                explicit = summary([p.grad for p in params], i)
                torch.nn.utils.clip_grad_norm_(params, 1e3)        # a clip that never bites: unscale_ must suffice
            n = len(calls)
            scaler.step(opt)
            ran = len(calls) > n
            grads = summary([p.grad for p in params], i)
            scaler.update()
            steps.append({"used": used, "ran": ran, "after": float(scaler.get_scale()), "explicit": explicit,
                          "grads": grads})
            opt.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    return {"steps": steps, "params": summary(params, 99)}
