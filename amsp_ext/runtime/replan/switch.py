"""``switch_plan(model, optimizer, plan)``: move a sharded model from one plan to another in
memory, between two steps, and keep training.

[Note: what a switch moves, and what stays]
The same processes, no files. What moves: every trainable tensor's fp32 master (under fp32 the
parameter itself), the inner optimizer's states of it, its param-group hyper-parameters (lr,
``initial_lr`` a scheduler set, ...), and frozen parameters. What stays: the model object, the
optimizer object (its hooks, step counter, loss scaler, non-finite guard; see [Note: the same
optimizer under another plan] in optimizer.py), so an LR scheduler bound to it goes on as if
nothing happened; buffers; each rank's RNG states (saved and restored around the switch); the
data position, which is the caller's loop's. The old plan's process groups are kept ([Note: the old
plan's groups stay alive]) and the new plan's built (topology/mesh.py), as ``shard`` does.

[Note: the resharding layout]
The layout is the checkpoints' (checkpoint.py, [Note: the layout as DCP chunks]): each local
tensor is a chunk of its global tensor at an offset on dim 0 (FSDP2's Shard(0)); masters and
states live only with the chunk's owners. Step 1 publishes, in one all-gather of a small table,
which rank owns which chunk (offset, length, state keys and dtypes, plus the chunk's scalars,
non-tensor states and hyper-parameters). Step 2 rebuilds every global tensor: each chunk is
broadcast once from its lowest-ranked owner, straight into its slice of the full tensor.
Step 3 undoes the old engine (hooks, FSDP2 via _torch_compat.fsdp_remove, groups) and puts
the full fp32 values back as the model's parameters, so step 4 is exactly ``shard``'s
construction on an fp32 model (engine.build_engine): the new owners' masters are their slices
of the old masters bit for bit, and a non-owner's compute-dtype parameter is the same rounding
of the master it held before. Step 5 gives the inner optimizer the slices of the states.

[Note: whole-tensor optimizers in a switch]
A whole-tensor optimizer (optim/kinds.py) holds each master and every state whole on one owner
per replica under every plan: the tensor itself under sp = 1, a whole master on a whole owner
under sp > 1 (optim/whole_tensor.py). So its chunk is the whole tensor at offset 0, each state
travels whole in its own shape (Adafactor's row and column factors too, which an elementwise
layout cannot slice), and the new plan's owner takes it whole; step 4 then gathers the new
whole masters from the rows as ``shard`` does. The owners come from the same per-tensor costs
as before the switch (``AMSPOptimizer.step_costs``).

Cost (the weak part, measured by the adaptive benchmarks): every rank holds the whole model
state for the duration of a switch (the full masters and states of step 2: 12 Phi bytes for
AdamW) and receives it over the world; a point-to-point exchange of only the overlapping
chunks would move (and hold) what each rank needs. An elementwise optimizer's states that are
neither shaped like the parameter nor scalars (e.g. factored states of row shards) are refused
with one line, before any change.

[Note: the old plan's groups stay alive]
A switch keeps the old plan's process groups (``engine.retired_meshes``) instead of destroying
them. In torch 2.13 a DeviceMesh compares equal by layout, not by its groups, and after a
switch back to an earlier plan the re-sharded parameters' DTensors were found holding the
earlier mesh: with its groups destroyed, ``full_tensor`` (consolidated_state_dict, full state
dicts on the integration routes) failed with "Could not resolve the process group registered
under the name N"; kept, it runs on groups of the same ranks. The cost is the old plan's gloo or
NCCL communicators (on 2 x 2: at most 7 groups, topology/mesh.py) per switch; the adaptive
policy switches rarely (hysteresis, min_steps_between_switches). Tested: tests/switch_worker.py
exports the full model after the switch back.

[Note: exactness]
Masters and states are copied, never recomputed: a switch changes no value. The steps after a
switch differ from the unswitched run only by the order in which the new plan's groups sum
gradients, the same ~1e-7 effect as between plans (tests/test_switch.py checks every step
against the single-process reference).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from amsp_ext.planner.plan import Plan
from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.state.checkpoint import reshard_all, rng_state, set_rng_state, engine_of, wait_for_save
from amsp_ext.runtime.engine import AMSPModule, Engine, build_engine
from amsp_ext.runtime.preflight import check_same_everywhere, job_of, resolve_on_ranks, run_fingerprint
from amsp_ext.runtime.optim.optimizer import AMSPOptimizer

__all__ = ["release_forward_only", "switch_plan"]


@torch.no_grad()
def switch_plan(model: nn.Module, optimizer: AMSPOptimizer, plan: "Plan | str") -> AMSPOptimizer:
    """Re-shard ``model`` and ``optimizer`` (from ``amsp_ext.shard``) under ``plan`` in place.

    Collective: every rank calls it with the same plan, between steps (after
    ``optimizer.zero_grad()``). ``plan``: anything ``shard`` takes (also ``"auto"``). Returns
    ``optimizer``, the same object, now over the new plan's owned masters; ``model`` is the
    same object too. A no-op (after the agreement check) when the plan does not change.
    """
    e = engine_of(model, optimizer)
    # e.config's all-reduce mode was decided at shard() and its profile found: a switch keeps
    # both, and plan "auto" is resolved as shard() resolves it (amsp_ext/job.py)
    new = resolve_on_ranks(e.comm, job_of(model, plan, e.config, e.world), e.world)[0].plan
    if e.grad_sync.owned or e.grad_sync.kept or e.grad_sync.mode is not None:
        raise ValueError("switch_plan: call it between steps (after optimizer.step() and "
                         "optimizer.zero_grad()), not with gradients pending")
    _check_optimizer_states(optimizer)
    # -- first collective: every rank switches to the same plan ------------------------------
    check_same_everywhere(e.comm, run_fingerprint(new, e.config, e.world, model), e.config)
    if new == e.plan:
        return optimizer
    t0 = time.perf_counter()
    wait_for_save(model)
    e.wait_params()
    reshard_all(model)
    optimizer.zero_grad()
    rng = rng_state(e.device)
    full = _gather(e, optimizer)
    frozen = _gather_frozen(model, e)
    _teardown(model, e, full, frozen)
    # the same context; the same optimizer, rebound ([Note: one assembly of an engine])
    engine = build_engine(model, new, e.world, e.config, e.device, e.comm, optimizer=optimizer, previous=e)
    _load_states(engine, optimizer, full)  # inner optimizer state only: the hooks do not read it
    set_rng_state(rng, e.device)
    C.barrier(e.comm, None, name="world", timeout=e.config.timeout)
    engine.switches.append({"step": optimizer.num_steps, "from": str(e.plan), "to": str(new),
                            "seconds": time.perf_counter() - t0})
    return optimizer


@torch.no_grad()
def release_forward_only(model: nn.Module) -> nn.Module:
    """Take a forward-only engine (sharded with no optimizer) off ``model``: every parameter
    gathered whole (fp32), FSDP2 and the hooks removed, the user's class back. Collective when
    sp > 1: every rank calls it. What a route does before it shards the same model for training
    (the HF Trainer evaluates before it trains: its first prepare has no optimizer)."""
    e = engine_of(model)
    if not e.forward_only:
        raise ValueError("release_forward_only: the model has an optimizer; switch_plan changes its plan")
    frozen = _gather_frozen(model, e)
    _teardown(model, e, {}, frozen)
    Engine.live.discard(e)  # no longer a frozen model beside the next one planned
    C.barrier(e.comm, None, name="world", timeout=e.config.timeout)
    return model


def _check_optimizer_states(opt: AMSPOptimizer) -> None:
    if opt.kind == "whole_tensor":  # every state travels whole ([Note: whole-tensor optimizers in a switch])
        return
    for idx, m in opt.masters.items():
        for k, v in opt.inner.state.get(m, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != tuple(m.shape):
                raise ValueError(
                    f"switch_plan: optimizer state {k!r} of {opt.tensors[idx].name!r} has shape "
                    f"{tuple(v.shape)}, neither the parameter's {tuple(m.shape)} nor a scalar; only "
                    f"such states can be re-sharded")


def _chunk(t, whole: bool = False) -> tuple[int, int]:
    """(offset, length) of this rank's chunk of ``t``'s master on dim 0: the whole tensor for a
    whole-tensor optimizer ([Note: whole-tensor optimizers in a switch])."""
    if whole:
        return 0, (t.global_shape[0] if t.global_shape else 1)
    off = compat.local_chunk_offset(t.param)
    return (off[0] if off else 0), (t.local_shape[0] if t.local_shape else 1)


def _rows(full: torch.Tensor, offset: int, length: int, whole: bool = False) -> torch.Tensor:
    """Rows ``offset:offset+length`` of ``full`` on dim 0, flat (a 0-d tensor is one row); all of
    it for a whole-tensor optimizer's state, whatever its shape."""
    if whole:
        return full.reshape(-1)
    row = full[0].numel() if full.dim() else 1
    return full.reshape(-1)[offset * row: (offset + length) * row]


def _gather(e: Engine, opt: AMSPOptimizer) -> dict[str, dict[str, Any]]:
    """Steps 1 and 2 of [Note: the resharding layout]: name -> {"master": full fp32 tensor,
    "states": {key: full tensor}, "scalars", "objects", "hp"} on every rank."""
    group_of = {id(p): g for g in opt.inner.param_groups for p in g["params"]}
    whole = opt.kind == "whole_tensor"
    mine = []
    for idx, m in opt.masters.items():
        t = e.tensors[idx]
        off, n = _chunk(t, whole)
        params, scalars, objects = {}, {}, {}
        for k, v in opt.inner.state.get(m, {}).items():
            if not torch.is_tensor(v):
                objects[k] = v
            elif v.dim() == 0:
                scalars[k] = v.detach().clone()
            else:  # the full tensor's shape: a whole-tensor optimizer's states are full already
                params[k] = (v.dtype, tuple(v.shape) if whole else tuple(t.global_shape))
        mine.append({"index": idx, "offset": off, "length": n, "states": params, "scalars": scalars,
                     "objects": objects,
                     "hp": {k: v for k, v in group_of[id(m)].items() if k != "params"}})
    table = C.all_gather_objects(e.comm, mine, None, name="world", timeout=e.config.timeout)
    # the lowest-ranked owner of each chunk serves it: (index, offset) -> (rank, row)
    source: dict[tuple[int, int], tuple[int, dict]] = {}
    for rank, rows in enumerate(table):
        for r in rows:
            if r["length"]:  # an empty chunk (more shards than rows) has nothing to serve
                source.setdefault((r["index"], r["offset"]), (rank, r))
    full: dict[str, dict[str, Any]] = {}
    for t in e.tensors:  # the same names and order on every rank
        chunks = sorted((off, src) for (i, off), src in source.items() if i == t.index)
        first = chunks[0][1][1]
        f = {"master": torch.empty(t.global_shape, dtype=torch.float32, device=e.device),
             "states": {k: torch.empty(shape, dtype=dt, device=e.device)
                        for k, (dt, shape) in sorted(first["states"].items())},
             "scalars": first["scalars"], "objects": first["objects"], "hp": first["hp"]}
        pending = []
        for off, (rank, r) in chunks:
            m = opt.masters.get(r["index"]) if rank == e.rank else None
            for key, target in [("master", f["master"]), *sorted(f["states"].items())]:
                piece = _rows(target, off, r["length"], whole)
                if piece.numel() == 0:
                    continue
                if m is not None:
                    piece.copy_((m if key == "master" else opt.inner.state[m][key]).reshape(-1))
                pending.append(C.broadcast(e.comm, piece, rank, None, name="world", stream=None,
                                           timeout=e.config.timeout))  # between steps: current stream
        for p in pending:
            C.wait(p)
        full[t.name] = f
    return full


def _gather_frozen(model: nn.Module, e: Engine) -> dict[int, torch.Tensor]:
    """Frozen parameters (not in the layout) as full tensors, by id (collective when sharded)."""
    trainable = {id(t.param) for t in e.tensors}
    out: dict[int, torch.Tensor] = {}
    for _, p in model.named_parameters():
        if id(p) not in trainable and id(p) not in out:
            out[id(p)] = C.full_tensor(e.comm, p.detach(), name=e.name("param_shard")).to(torch.float32)
    return out


def _teardown(model: nn.Module, e: Engine, full: dict, frozen: dict[int, torch.Tensor]) -> None:
    """Step 3: hooks, FSDP2 and the old groups out; the full fp32 values in as plain
    parameters (tied parameters stay one Parameter)."""
    e.grad_sync.remove()
    e.param_sync.remove()
    if e.outer_gather is not None:
        e.outer_gather.remove()
    value = {id(t.param): full[t.name]["master"] for t in e.tensors}
    value.update(frozen)
    replaced: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for k, p in list(m.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in replaced:
                replaced[id(p)] = nn.Parameter(value[id(p)], requires_grad=p.requires_grad)
            setattr(m, k, replaced[id(p)])
    model.__class__ = next(c for c in type(model).__mro__ if not issubclass(c, AMSPModule))
    model.__dict__.pop("amsp", None)
    for m in list(model.modules()):
        if isinstance(m, FSDPModule):
            compat.fsdp_remove(m)
    # [Note: the old plan's groups stay alive] - not destroy_plan_mesh(e.mesh)


def _load_states(engine: Engine, opt: AMSPOptimizer, full: dict) -> None:
    """Step 5: the owned slices of the states and the hyper-parameters, through the inner
    optimizer's own ``load_state_dict`` (which casts ``step`` & co. as that optimizer wants)."""
    inner_sd = opt.inner.state_dict()
    pos = {id(p): i for i, p in enumerate(p for g in opt.inner.param_groups for p in g["params"])}
    state = {}
    whole = opt.kind == "whole_tensor"
    for idx, m in opt.masters.items():
        t = engine.tensors[idx]
        f = full[t.name]
        off, n = _chunk(t, whole)
        st: dict[str, Any] = {k: v.clone() if whole else _rows(v, off, n).clone().view(t.local_shape)
                              for k, v in f["states"].items()}
        st.update({k: v.clone() for k, v in f["scalars"].items()})
        st.update(f["objects"])
        if st:
            state[pos[id(m)]] = st
    inner_sd["state"] = state
    names = [t.name for t in engine.tensors]
    for g_sd, g in zip(inner_sd["param_groups"], opt.inner.param_groups):
        gnames = [p.amsp_name for p in g["params"] if hasattr(p, "amsp_name")]
        if not gnames and not opt.masters:
            gnames = names[:1]  # the placeholder group of a rank that owns nothing
        if gnames:
            g_sd.update(full[gnames[0]]["hp"])
    opt.inner.load_state_dict(inner_sd)
