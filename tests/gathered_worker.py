"""2-rank worker for tests/test_gathered_parameters.py: ``deepspeed.zero.GatheredParameters`` on
the parameters of a routed ``deepspeed.initialize`` (ds_config ZeRO stage 3 + an ``amsp`` block),
each case against a single-process model built from the same seed. Prints ``RESULT {json}``.

Usage: python -m tests.fork_launch 2 torch,amsp,deepspeed tests.gathered_worker PLAN[;PLAN]
           CASE[,CASE][;CASE[,CASE]] [bf16]
(one list of cases per plan; ``PLAN <plan>`` is printed before each plan's results)
  read      read inside the context equals the full weights; collectives per unit; nesting
  generate  model.generate inside one context over every parameter: no gather per token
  write     modifier_rank=0 writes reach every rank's shard and the fp32 masters; the next step
            trains from them like the single-process reference
  refuse    unsupported uses stop with one line naming the parameter
  handle    a handle taken before entering: its .data and conversions are the full weight
            inside (OpenRLHF's weight sync), a write through it with modifier_rank reaches
            every shard, one without is refused
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss
from amsp_ext.runtime import _torch_compat as compat

Q = "model.layers.0.self_attn.q_proj.weight"
O = "model.layers.1.self_attn.o_proj.weight"
EMB = "model.embed_tokens.weight"


def config(plan, precision="fp32"):
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    return {**extra, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3},
            "amsp": {"enabled": True, "plan": plan, "gpus_per_node": 2, "timeout": 60}}


def emit(case, **res):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"case": case, **res}), flush=True)


def worst(x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def counts(engine, before):
    now = engine.module.amsp.comm.counts
    return {f"{op}:{kind}": n - before.get((op, kind), 0) for (op, kind), n in now.items()
            if n != before.get((op, kind), 0)}


def snap(engine):
    return dict(engine.module.amsp.comm.counts)


def get(model, name):
    mod, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(mod), attr)


def units_of(engine, names=None):
    """How many FSDP units hold these parameters (all: None); 0 when sp = 1."""
    from amsp_ext.integrations.gathered import _index

    ts = _index(engine.module.amsp).values()
    return len({id(t.unit) for t in ts if t.unit is not None and (names is None or t.name in names)})


def case_read(engine, ref, gp):
    m = engine.module
    q, lm = get(m, Q), get(m, "lm_head.weight")
    c0 = snap(engine)
    with gp([q, lm]):  # handles taken before: sharded DTensors when sp > 1
        inside = {n: get(m, n) for n in (Q, "lm_head.weight")}
        enter = counts(engine, c0)
        diff = max(float((inside[n] - get(ref, n)).detach().abs().max()) for n in inside)
        plain = all(type(t).__name__ == "Parameter" for t in inside.values())
        c1 = snap(engine)
        with gp(list(m.parameters())):  # nested, over gathered units and the rest
            c2 = snap(engine)
            with gp(get(m, Q)):  # innermost: everything already gathered
                innermost = counts(engine, c2)
            nested = counts(engine, c1)
            full_diff = max(float((p - ref.get_parameter(n)).abs().max()) for n, p in m.named_parameters())
    after = type(get(m, Q)).__name__
    emit("read", max_abs_diff=worst(diff), full_max_abs_diff=worst(full_diff), plain=plain,
         enter=enter, nested=nested, innermost=innermost, after_type=after,
         units=units_of(engine), units_read=units_of(engine, {Q, "lm_head.weight"}), sp=m.amsp.plan.sp)


def case_generate(engine, ref, gp):
    m = engine.module
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    c0 = snap(engine)
    with gp(m.parameters(), modifier_rank=0):  # a generator, as scripts pass it
        c1 = snap(engine)
        got = m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        during = counts(engine, c1)
        enter = {k: v for k, v in counts(engine, c0).items() if k not in during}
    total = counts(engine, c0)
    emit("generate", same_tokens=bool(torch.equal(got, want)), enter=enter, during=during,
         total=total, new_tokens=8, units=units_of(engine))


def step_both(engine, ref, ref_opt):
    """One step of the engine and of the reference (the mean of both ranks' losses)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [micro_batch(0, 0, r, world_size=world, num_micro_batches=1, micro_batch_size=1,
                           seq_len=16) for r in range(world)]
    loss = causal_lm_loss(engine, batches[rank])
    engine.backward(loss)
    engine.step()
    ref_losses = [causal_lm_loss(ref, b) for b in batches]
    (sum(ref_losses) / world).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return abs(loss.item() - ref_losses[rank].item())


def case_write(engine, ref, gp):
    m = engine.module
    rank = dist.get_rank()
    with torch.no_grad():  # the reference takes the same writes
        new_q = -get(ref, Q) + 0.01
        new_o = torch.full_like(get(ref, O), 0.003)
        get(ref, Q).copy_(new_q)
        get(ref, O).copy_(new_o)
        get(ref, EMB)[7] = 0.5
    names = [Q, O, EMB]
    c0 = snap(engine)
    with gp([get(m, n) for n in names], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                get(m, Q).data.copy_(new_q)  # in place
                mod = m.get_submodule(O.rpartition(".")[0])
                mod.weight = torch.nn.Parameter(new_o.clone())  # replaced
                get(m, EMB)[7] = 0.5  # one row
        else:  # a non-modifier's write is dropped, as in DeepSpeed
            with torch.no_grad():
                get(m, Q).data.add_(100.0)
    exit_counts = counts(engine, c0)
    shard_diff, master_diff, checked_masters = 0.0, 0.0, 0
    opt = engine.optimizer
    for t in m.amsp.tensors:
        if t.name not in names:
            continue
        shape, off = compat.local_chunk(t.param)
        local = compat.dtensor_local(t.param)
        want = get(ref, t.name)[tuple(slice(o, o + s) for o, s in zip(off, shape))].to(local.dtype)
        shard_diff = max(shard_diff, float((local - want).abs().max()))
        if t.owner_rank == rank:
            master = opt.local_masters[t.index]
            # the master holds exactly what the shard got (fp32 of it under bf16)
            master_diff = max(master_diff, float((master.view(local.shape) - local.float()).abs().max()))
            checked_masters += 1
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    loss_diff = step_both(engine, ref, ref_opt)
    sd = engine.state_dict()
    after = max(float((sd[n].float() - p).detach().abs().max()) for n, p in ref.named_parameters())
    moved = float((sd[Q].float() - new_q).abs().max())
    masters = torch.tensor([checked_masters])
    dist.all_reduce(masters)
    emit("write", shard_max_abs_diff=worst(shard_diff), master_max_abs_diff=worst(master_diff),
         masters_checked=int(masters), step_loss_diff=worst(loss_diff), after_step_max_abs_diff=worst(after),
         q_moved_by_step=moved, exit=exit_counts, units_written=units_of(engine, set(names)))


def case_handle(engine, ref, gp):
    """OpenRLHF's weight sync: each handle taken before its context, read inside through
    ``p.data`` (and the usual conversions) and broadcast; then a write through ``p.data`` with
    and without ``modifier_rank`` ([Note: a handle taken before entering])."""
    m = engine.module
    rank = dist.get_rank()
    diff, types, inside, after = 0.0, set(), set(), set()
    for name, p in m.named_parameters():  # the handle, before any context
        want = get(ref, name).detach()
        with gp([p], enabled=True):
            inside.add(f"{type(p).__name__}:{isinstance(p, DTensor)}")
            reads = [p.data, p.detach(), p.cpu(), p.to(torch.float32), p.clone(), p.contiguous(), p.float()]
            types.update(type(r).__name__ for r in reads)
            diff = max([diff] + [float((r.detach() - want).abs().max()) for r in reads])
            # rank 0 sends the whole weight (to vLLM in OpenRLHF; to rank 1 here)
            buf = p.data if rank == 0 else torch.empty(tuple(p.shape), dtype=p.dtype)
            dist.broadcast(buf, 0)
            diff = max(diff, float((buf - want).abs().max()))
        after.add(type(p).__name__)
    q = get(m, Q)
    new_q = get(ref, Q).detach() * -0.5
    with torch.no_grad():
        get(ref, Q).copy_(new_q)  # the reference takes the modifier's write
    with gp([q], modifier_rank=0), torch.no_grad():
        if rank == 0:
            q.data.copy_(new_q)  # through the handle taken before entering
    shape, off = compat.local_chunk(q)
    rows = new_q[tuple(slice(o, o + s) for o, s in zip(off, shape))]
    written = float((compat.dtensor_local(q) - rows).abs().max())
    t = next(t for t in m.amsp.tensors if t.name == Q)
    if t.owner_rank == rank:  # the owner's fp32 master took it too
        master = engine.optimizer.local_masters[t.index].view(compat.dtensor_local(q).shape)
        written = max(written, float((master - rows).abs().max()))

    def unflagged():
        with gp([q]), torch.no_grad():
            q.data.add_(1.0)
    refused = one_line(unflagged)
    kept = float((compat.dtensor_local(q) - rows).abs().max())
    if m.amsp.plan.sp == 1:  # the handle is the parameter itself: the refused write stays there
        with torch.no_grad():
            q.data.sub_(1.0)
    emit("handle", max_abs_diff=worst(diff), read_types=sorted(types), inside=sorted(inside),
         after=sorted(after), written_max_abs_diff=worst(written), refused=refused,
         kept_max_abs_diff=worst(kept), sp=m.amsp.plan.sp)


def one_line(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def case_refuse(engine, ref, gp):
    m = engine.module
    sp = m.amsp.plan.sp
    out = {}

    def unflagged_write():
        with gp(get(m, Q)), torch.no_grad():
            get(m, Q).data.add_(1.0)
    out["no_modifier"] = one_line(unflagged_write)
    out["fwd_module"] = one_line(lambda: gp(get(m, Q), fwd_module=m))
    out["bad_rank"] = one_line(lambda: gp(get(m, Q), modifier_rank=7))
    if sp > 1:
        w = get(m, Q)  # the sharded handle

        def stale_write():
            with gp(w, modifier_rank=0):
                if dist.get_rank() == 0:
                    with torch.no_grad():
                        w.mul_(2.0)
        out["stale_handle"] = one_line(stale_write)
        if dist.get_rank() == 0:
            with torch.no_grad():
                w.mul_(0.5)

        def resize():
            with gp(get(m, Q), modifier_rank=0):
                if dist.get_rank() == 0:
                    mod = m.get_submodule(Q.rpartition(".")[0])
                    mod.weight = torch.nn.Parameter(torch.zeros(3, 3))
        out["reshape"] = one_line(resize)
    same = max(float((p - ref.get_parameter(n)).abs().max()) for n, p in engine.state_dict().items())
    emit("refuse", messages=out, unchanged_max_abs_diff=worst(same), still_sharded=type(get(m, Q)).__name__)


CASES = {"read": case_read, "generate": case_generate, "refuse": case_refuse, "write": case_write,
         "handle": case_handle}


def main():
    import deepspeed

    import amsp_ext

    amsp_ext.patch_deepspeed()
    plans, cases = sys.argv[1].split(";"), sys.argv[2].split(";")
    precision = sys.argv[3] if len(sys.argv) > 3 else "fp32"
    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    for plan, names in zip(plans, cases, strict=True):
        if dist.get_rank() == 0:
            print(f"PLAN {plan}", flush=True)
        ref = build_llama("tiny-llama", seed=0)
        engine, *_ = deepspeed.initialize(model=build_llama("tiny-llama", seed=0), config=config(plan, precision))
        for name in names.split(","):
            CASES[name](engine, ref, deepspeed.zero.GatheredParameters)
        dist.barrier()
    if dist.get_rank() == 0:
        print(f"DONE {time.perf_counter() - t0:.1f}s", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
