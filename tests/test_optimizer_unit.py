"""AMSPOptimizer without any process group: built from its collaborators (a local gradient source,
no broadcaster, ``NormGroup()``), it must behave as a torch optimizer. The reference is plain
torch: the same inner optimizer stepping an identical model directly, compared at every step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.optim import lr_scheduler as S
from torch.optim import swa_utils
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from amsp_ext.runtime.optim.layout import LocalTensor
from amsp_ext.runtime.optim.optimizer import AMSPOptimizer, NormGroup

STEPS = 8


class LocalGrads:
    """One process owns every tensor: the owned gradients are the parameters' own ``.grad``."""

    def __init__(self, tensors):
        self.tensors = tensors

    @property
    def owned(self):
        return {t.index: t.param.grad for t in self.tensors if t.param.grad is not None}

    def collect(self):
        return self.owned

    def zero_grad(self, set_to_none=True):
        for t in self.tensors:
            if set_to_none:
                t.param.grad = None
            elif t.param.grad is not None:
                t.param.grad.zero_()


class NoBroadcast:
    def __init__(self):
        self.calls = []

    def broadcast_all(self):
        self.calls.append("broadcast")

    def wait_all(self):
        self.calls.append("wait")


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    data = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(STEPS)]
    return model, data


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def amsp_over(model, factory=adamw, precision="fp32", broadcaster=None):
    """The engine's construction of an AMSPOptimizer, for one process that owns everything."""
    tensors = [LocalTensor(index=i, name=n, param=p, unit=0, global_shape=tuple(p.shape),
                           local_shape=tuple(p.shape), shard_index=0, owner_rank=0, keeper_rank=0)
               for i, (n, p) in enumerate(model.named_parameters())]
    masters = {}
    for t in tensors:
        m = nn.Parameter(t.param.data if precision == "fp32" else t.param.detach().float().clone())
        m.amsp_name = t.name
        masters[t.index] = m
    if precision != "fp32":
        model.to({"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
    return AMSPOptimizer(masters, factory, tensors=tensors, grads=LocalGrads(tensors),
                         params=broadcaster or NoBroadcast(), norm_group=NormGroup(),
                         device=torch.device("cpu"), precision=precision)


def loss_of(model, x, y):
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def run(model, opt, data, sched=None, sched_step=None, clip=None, after_step=None):
    losses, lrs = [], []
    for x, y in data:
        loss = loss_of(model, x, y)
        loss.backward()
        if clip is not None:
            if isinstance(opt, AMSPOptimizer):
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        lrs.append(opt.param_groups[0]["lr"])
        if sched is not None:
            (sched_step or (lambda s, l: s.step()))(sched, loss.item())
        if after_step is not None:
            after_step()
        losses.append(loss.item())
    return losses, lrs


def assert_same_params(a: nn.Module, b: nn.Module, atol=0.0):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.allclose(p.float(), q.float(), rtol=0, atol=atol), (n, (p.float() - q.float()).abs().max())


def test_builds_and_steps_without_a_process_group():
    assert not torch.distributed.is_initialized()
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    bc = NoBroadcast()
    opt = amsp_over(model, broadcaster=bc)
    ref_opt = adamw(ref.parameters())
    for x, y in data:  # every step, not just the last
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_of(m, x, y).backward()
            o.step()
            o.zero_grad()
        assert_same_params(model, ref)
    assert opt.num_steps == STEPS
    # waits before, broadcasts after each step, and waits for them before step() returns
    # (optimizer.py [Note: parameters current after step()])
    assert bc.calls == ["wait", "broadcast", "wait"] * STEPS


def test_clipping_matches_torch_every_step():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt = amsp_over(model)
    norms = []
    got, _ = run(model, opt, data, clip=0.05, after_step=lambda: norms.append(opt.last_grad_norm))
    want, _ = run(ref, adamw(ref.parameters()), data, clip=0.05)
    assert min(norms) > 0.05  # clipping was active on every step
    # the same coefficient, computed as a Python float here and an fp32 tensor in torch
    assert got == pytest.approx(want, rel=1e-6)
    assert_same_params(model, ref, atol=1e-6)


SCHEDULERS = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda s: 1.0 / (s + 1)),
    "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.8),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=5),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS),  # cycles betas too
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2, cycle_momentum=False),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.2, total_iters=4),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=6, power=2.0),
    "SequentialLR": lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3),
                                                 S.ExponentialLR(o, gamma=0.7)], milestones=[3]),
    "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=3),
                                                      S.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0, threshold=10.0),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers(name):
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt, ref_opt = amsp_over(model), adamw(ref.parameters())
    plateau = name == "ReduceLROnPlateau"
    step = (lambda s, loss: s.step(loss)) if plateau else None
    got, got_lr = run(model, opt, data, SCHEDULERS[name](opt), step)
    want, want_lr = run(ref, ref_opt, data, SCHEDULERS[name](ref_opt), step)
    assert got_lr == want_lr and len(set(got_lr)) > 1, (got_lr, want_lr)  # the schedule moved
    assert got == want
    assert_same_params(model, ref)
    if name == "OneCycleLR":
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]


def test_swa_averaged_model_and_swalr():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt, ref_opt = amsp_over(model), adamw(ref.parameters())
    swa, ref_swa = swa_utils.AveragedModel(model), swa_utils.AveragedModel(ref)
    got, got_lr = run(model, opt, data, swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=3),
                      after_step=lambda: swa.update_parameters(model))
    want, want_lr = run(ref, ref_opt, data, swa_utils.SWALR(ref_opt, swa_lr=0.05, anneal_epochs=3),
                        after_step=lambda: ref_swa.update_parameters(ref))
    assert got == want and got_lr == want_lr and got_lr[-1] == pytest.approx(0.05)
    assert int(swa.n_averaged) == STEPS
    assert_same_params(swa.module, ref_swa.module)


def test_step_hooks_instance_and_global():
    model, data = model_and_data()
    opt = amsp_over(model)
    seen = []
    h1 = opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o.num_steps)))
    h2 = opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o.num_steps)))
    glob = []
    g1 = register_optimizer_step_pre_hook(lambda o, a, k: glob.append(("pre", type(o).__name__)))
    g2 = register_optimizer_step_post_hook(lambda o, a, k: glob.append(("post", type(o).__name__)))
    try:
        run(model, opt, data[:2])
    finally:
        for h in (h1, h2, g1, g2):
            h.remove()
    assert seen == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2)]
    # the AMSP step is the outer one; the inner optimizer is a real optimizer stepped inside it
    assert glob == [("pre", "AMSPOptimizer"), ("pre", "AdamW"), ("post", "AdamW"), ("post", "AMSPOptimizer")] * 2
    run(model, opt, data[:1])
    assert len(seen) == 4  # removed hooks stay removed


def test_state_dict_round_trip_and_hooks():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt, ref_opt = amsp_over(model), adamw(ref.parameters())
    run(model, opt, data[:3])
    run(ref, ref_opt, data[:3])
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda o, sd: (calls.append("sd_post"), {**sd, "tag": 1})[1])
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    sd = copy.deepcopy(opt.state_dict())
    assert sd["tag"] == 1 and sd["amsp"]["num_steps"] == 3
    assert sd["param_groups"] == ref_opt.state_dict()["param_groups"]  # torch's layout
    for k, v in ref_opt.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][k][name], v[name])
    # train on from the saved state in a fresh optimizer over a model that went elsewhere
    run(model, opt, data[3:5])
    fresh_model = copy.deepcopy(model)
    fresh = amsp_over(fresh_model)
    fresh.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    fresh.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    fresh.load_state_dict(sd)
    assert fresh.num_steps == 3
    got, _ = run(fresh_model, fresh, data[3:])
    want, _ = run(ref, ref_opt, data[3:])
    assert got == want
    assert_same_params(fresh_model, ref)
    assert calls == ["sd_pre", "sd_post", "load_pre", "load_post"]
    sd["amsp"]["tensors"] = sd["amsp"]["tensors"][:1]
    with pytest.raises(ValueError, match="owns other tensors"):
        fresh.load_state_dict(sd)


def test_zero_grad_set_to_none_is_honoured():
    model, data = model_and_data()
    opt = amsp_over(model)
    masters = list(opt.masters.values())
    x, y = data[0]
    loss_of(model, x, y).backward()
    opt.step()
    assert all(m.grad is not None for m in masters)  # kept until zero_grad, as in torch
    opt.zero_grad(set_to_none=False)
    assert all(m.grad is not None and not m.grad.any() for m in masters)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()  # default: to None
    assert all(m.grad is None for m in masters) and all(p.grad is None for p in model.parameters())


def test_closure_and_add_param_group():
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt, ref_opt = amsp_over(model), adamw(ref.parameters())
    x, y = data[0]

    def closure(m, o):
        def f():
            o.zero_grad()
            loss = loss_of(m, x, y)
            loss.backward()
            return loss
        return f

    assert float(opt.step(closure(model, opt)).detach()) == float(ref_opt.step(closure(ref, ref_opt)).detach())
    assert_same_params(model, ref)
    with pytest.raises(ValueError, match="optimizer_factory"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_bf16_masters_written_back_and_fp16_overflow_skips():
    """Mixed precision: fp32 masters stepped, compute-dtype parameters written back from them;
    under fp16 a non-finite gradient skips the step and backs the scale off."""
    model, data = model_and_data()
    ref = copy.deepcopy(model)
    opt = amsp_over(model, precision="bf16")
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref.to(torch.bfloat16)
    ref_opt = adamw(masters)
    for x, y in data:
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        loss_of(ref, x, y).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad, p.grad = p.grad.float(), None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        assert_same_params(model, ref)
        for m, r in zip(opt.masters.values(), masters):
            assert torch.equal(m, r)
    model16, _ = model_and_data()
    opt16 = amsp_over(model16, precision="fp16")
    before = [p.detach().clone() for p in model16.parameters()]
    x, y = data[0]
    opt16.backward(loss_of(model16, x, y) * math.inf)
    opt16.step()
    assert opt16.skipped_steps == 1 and opt16.loss_scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model16.parameters()))
