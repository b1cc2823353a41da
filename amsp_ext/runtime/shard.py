"""``shard(model, plan, optimizer_factory, config=...)``: the one entry point of the engine.

It reads as its three steps (preflight.py [Note: preflight, resolve, assemble]): the preflight
checks the arguments and builds the job, resolving decides its plan and all-reduce mode
(amsp_ext/job.py), and engine.build_engine assembles the engine in the order of [Note: order of
construction] ([Note: one assembly of an engine]), which gives the optimizer, with
``ShardConfig.adaptive``, the monitor (runtime/replan/adaptive.py; [Note: where a switch
happens] there). A module of its own because the monitor switches plans (switch.py), which
rebuilds engines: ``engine <- switch <- adaptive <- shard`` is one-way only if ``shard`` lives
above all three.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from amsp_ext.common.faults import faults
from amsp_ext.job import ResolvedJob, problem
from amsp_ext.planner.adaptive import check_replannable
from amsp_ext.planner.plan import Plan
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.materialize import check_initializable, fill, model_on_meta
from amsp_ext.runtime.replan.adaptive import AdaptiveRun
from amsp_ext.runtime.state.init_source import open_init_source
from amsp_ext.runtime.tensor_parallel import check_tensor_parallel, check_tp_plan
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.runtime.engine import Engine, build_engine
from amsp_ext.planner.defaults import DEFAULT_OPTIMIZER
from amsp_ext.runtime.optim.kinds import Detected, detect_kind, planner_optimizer
from amsp_ext.runtime.optim.optimizer import AMSPOptimizer
from amsp_ext.runtime.preflight import (check_same_everywhere, enable_recompute, engine_device, job_of, plan_world,
                                        resolve_on_ranks, run_fingerprint, same_initial_weights)

__all__ = ["check_not_sharded", "shard"]


def shard(model: nn.Module, plan: "Plan | str | ResolvedJob",
          optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, *,
          config: ShardConfig | None = None,
          init_from=None,
          comm: C.CollectiveContext | None = None) -> tuple[nn.Module, AMSPOptimizer]:
    """Shard ``model`` under ``plan``; return it and its optimizer.

    ``model``: fp32 and whole on every rank (rank 0's weights are broadcast to the others,
    ``config.init_weights``), or built under ``torch.device("meta")``: then each rank allocates
    only what its plan keeps and fills it from the model's own initializer seeded by
    ``config.init_seed`` (the same weights under every plan and world size), or from
    ``init_from`` (= ``config.init_from``): a Hugging Face safetensors folder or an amsp
    checkpoint, each rank reading only its rows (runtime/materialize.py).

    ``plan``: a Plan, a factor string ``"p=2x1,g=2x1,os=2x2"``, a name (``ddp``, ``zero1``,
    ``zero2``, ``zero3``, ``mics:K``), ``"auto"``, or a ``ResolvedJob`` a launcher resolved
    (amsp_ext/job.py; its job's engine settings are then the config: pass no other).
    ``optimizer_factory(masters)`` builds the inner optimizer over the fp32 masters this rank
    owns (a list, forward order; each master has ``.amsp_name``, the model's parameter name,
    to build param groups from). None: a forward-only model (a reference, reward or teacher
    model): its parameters are sharded as the plan's p factors say, with no gradient, master or
    optimizer state (g and os are ignored), and the optimizer returned is None
    (sync/grad_sync.py [Note: a model without an optimizer]).
    ``comm``: the engine's collective context (collectives.py [Note: the collective context]);
    a caller passes its own to count or observe the engine's collectives from the first one on
    (None: a new one with ``config.timeout``). It is ``model.amsp.comm`` afterwards.
    """
    # -- preflight: the arguments, the world and the job, no collective ------------------------
    t_start = time.perf_counter()
    resolved = plan if isinstance(plan, ResolvedJob) else None
    config, comm = _checked(model, plan, optimizer_factory, config, init_from, comm, resolved)
    world = plan_world(config)
    detected, config = _optimizer_kind(model, optimizer_factory, config, world, resolved)
    config = _frozen_beside(model, optimizer_factory, config, resolved)
    job = resolved.job if resolved is not None else job_of(model, plan, config, world)
    # -- resolve: the plan and the all-reduce mode (amsp_ext/job.py) ---------------------------
    profile_source = resolved.profile_source if resolved is not None else None
    if resolved is None:  # measure/cluster.py [Note: where the measurement runs]
        resolved, source = resolve_on_ranks(comm, job, world)
        profile_source = source.as_dict() if source is not None else None
    plan, config = resolved.plan, dataclasses.replace(resolved.engine, init_from=config.init_from)
    if optimizer_factory is None:
        plan = _forward_only(plan)
    # the monitor's planner problem (reads the profile), before any collective: bad input fails here
    monitor_problem = problem(resolved) if config.adaptive is not None else None
    # initial values: the files are opened and checked against the model here, before any collective
    on_meta = model_on_meta(model)
    check_tensor_parallel(model, world, adaptive=config.adaptive)
    check_tp_plan(plan, world)
    init = open_init_source(config.init_from, model) if config.init_from is not None else None
    if on_meta:
        check_initializable(model, from_files=init is not None)
    C.destroy_groups_at_exit()  # collectives.py [Note: process groups torn down at exit]
    # -- first collective: every rank about to build the same engine ---------------------------
    check_same_everywhere(comm, run_fingerprint(plan, config, world, model), config)
    device = engine_device(model)
    if not on_meta:
        if device.type != "cpu":
            model.to(device)
        if init is not None:  # every rank holds the model whole: it reads it whole
            fill(model, device=device, seed=config.init_seed, source=init, init_buffers=False)
        else:
            same_initial_weights(comm, model, config, world)
    if config.recompute:
        enable_recompute(model)
    # -- assemble ----------------------------------------------------------------------------
    monitor = None
    if config.adaptive is not None:  # runtime/replan/adaptive.py: every optimizer.step() is a boundary
        def monitor(parts):
            return AdaptiveRun(model, monitor_problem, config.adaptive, plan=parts.plan, world=parts.world,
                               comm=comm, timeout=config.timeout,
                               first_switch_cost_s=time.perf_counter() - t_start, faults=faults())
    if detected.kind == "whole_tensor" and plan.sp > 1 and dist.get_rank() == 0:
        print(f"[amsp] the optimizer reads whole tensors (optimizer_kind {config.optimizer_kind}): under "
              f"plan {plan} each tensor is stepped whole by one rank of its param_shard group "
              f"(optim/whole_tensor.py)", file=sys.stderr, flush=True)
    engine = build_engine(model, plan, world, config, device, comm, optimizer_factory=optimizer_factory,
                          optimizer_kind=detected.kind, optimizer_costs=detected.costs, monitor=monitor,
                          initial=(config.init_seed, init) if on_meta else None, profile_source=profile_source)
    return model, engine.optimizer


def _optimizer_kind(model: nn.Module, optimizer_factory, config: ShardConfig, world,
                    resolved: ResolvedJob | None) -> tuple[Detected, ShardConfig]:
    """``(what the factory builds, config)`` (optim/kinds.py): the combinations not built
    for a whole-tensor optimizer refused in one line, before any collective; plan "auto" set to
    price the whole-tensor optimizer that will run unless the config names one."""
    if optimizer_factory is None:
        return Detected("elementwise", "none"), config  # no optimizer: nothing is stepped
    detected = detect_kind(optimizer_factory, model.named_parameters(), config.optimizer_kind)
    name = detected.name
    if detected.kind == "whole_tensor":
        if world.tensor_parallel > 1:
            raise ValueError(f"optimizer {name} reads whole tensors (optimizer_kind), and tensor "
                             f"parallelism splits them: not built yet; use an elementwise optimizer "
                             f"(AdamW, SGD, ...) with TP, or declare it optimizer_kind='elementwise'")
        if config.adaptive is not None:
            raise ValueError(f"config.adaptive: optimizer {name} reads whole tensors, and adaptive "
                             f"re-planning is not tested with them yet; turn adaptive off (amsp_ext."
                             f"switch_plan moves their states between plans by hand)")
        if resolved is None and config.auto is not None and config.auto.optimizer == DEFAULT_OPTIMIZER:
            config = dataclasses.replace(config, auto=dataclasses.replace(
                config.auto, optimizer=planner_optimizer(name)))
    return detected, config


def _frozen_beside(model: nn.Module, optimizer_factory, config: ShardConfig,
                   resolved: ResolvedJob | None) -> ShardConfig:
    """Plan "auto" of a trained model with ``auto.frozen_models`` unset counts the forward-only
    engines already alive in this process (TRL builds the reference before the policy) in
    model-sized units, rounded up (planner/specs.py [Note: frozen models])."""
    if optimizer_factory is None or resolved is not None or config.auto is None \
            or config.auto.frozen_models is not None:
        return config
    size = sum(p.numel() for p in model.parameters())
    frozen = sum(e.num_params for e in list(Engine.live) if e.forward_only)
    return dataclasses.replace(config, auto=dataclasses.replace(
        config.auto, frozen_models=-(-frozen // size) if size else 0))


def _forward_only(plan: Plan) -> Plan:
    """A forward-only model's plan: the p factors; g and os are ignored (one line says so)."""
    kept = Plan(s0_p=plan.s0_p, s1_p=plan.s1_p, s0_g=plan.s0_p, s1_g=plan.s1_p, s0_os=plan.s0_p,
                s1_os=plan.s1_p)
    if kept != plan and dist.get_rank() == 0:
        print(f"[amsp] forward-only model (no optimizer): plan {plan} runs as {kept}, its parameters "
              f"sharded by p; the g and os factors are ignored", file=sys.stderr, flush=True)
    return kept


def _checked(model, plan, optimizer_factory, config, init_from, comm, resolved):
    """``(config, comm)``: the arguments checked (one line each), the config a ResolvedJob
    carries or the one given, ``init_from`` in it, the collective context to use."""
    if resolved is not None:
        if config is not None:
            raise ValueError("amsp_ext.shard: a ResolvedJob carries its engine config (job.engine); "
                             "pass it without config=")
        config = resolved.job.engine
    _check_arguments(model, plan, optimizer_factory)
    config = config or ShardConfig()
    if not isinstance(config, ShardConfig):
        raise ValueError(f"config must be a ShardConfig, got {type(config).__name__}")
    if comm is not None and not isinstance(comm, C.CollectiveContext):
        raise ValueError(f"comm must be a collectives.CollectiveContext, got {type(comm).__name__}")
    if init_from is not None:
        config = dataclasses.replace(config, init_from=str(init_from))
    if optimizer_factory is None and config.adaptive is not None:
        raise ValueError("config.adaptive: a forward-only model (optimizer_factory None) takes no "
                         "steps to adapt at; turn adaptive off for it")
    # the request, not the plan it resolves to: adaptive may replace a plan asked as "auto" only
    check_replannable(resolved.job.plan if resolved is not None else plan, config.adaptive,
                      flag="config.adaptive.allow_replan")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("amsp_ext.shard needs torch.distributed initialized (torchrun + init_process_group)")
    check_not_sharded(model)
    return config, comm if comm is not None else C.CollectiveContext(timeout=config.timeout)


def check_not_sharded(model: nn.Module) -> None:
    """[Note: one engine per parameter]
    A process may hold several engines (an actor and a critic, each with its optimizer; a
    policy beside a frozen reference), each owning its model's parameters: its gradient hooks,
    its masters and its post-step broadcasts. A parameter reached by two engines - a critic
    built around the actor's already sharded backbone - would be reduced, stepped and
    broadcast twice; with sp = 1 nothing else notices (the parameter is a plain tensor), with
    sp > 1 the DTensor check read as a tensor-parallel model. Refused here, before any
    collective (shard's preflight, and ``amsp_ext.initialize`` before its broadcast), naming
    the parameter and the engine that holds it."""
    if getattr(model, "amsp", None) is not None:
        raise ValueError("model is already sharded by amsp_ext.shard")
    held = {id(p): (e, name) for e in list(Engine.live) for u in e.units for name, p in u.params}
    for name, p in model.named_parameters():
        if id(p) in held:
            e, other = held[id(p)]
            raise ValueError(
                f"amsp_ext.shard: parameter {name!r} of {type(model).__name__} already belongs to "
                f"another engine (its {other!r}, {type(e.units[0].module).__name__} under plan {e.plan}); "
                f"two engines cannot share a parameter: shard a copy (copy.deepcopy of the module "
                f"before sharding either model) or one model holding both")


def _check_arguments(model, plan, optimizer_factory) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"amsp_ext.shard: model must be a torch.nn.Module, got {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise ValueError(f"amsp_ext.shard: model {type(model).__name__} has no parameters; there is "
                         f"nothing to shard or train")
    if optimizer_factory is not None and (not callable(optimizer_factory)
                                          or isinstance(optimizer_factory, torch.optim.Optimizer)):
        raise ValueError(
            f"amsp_ext.shard: optimizer_factory must be a callable that builds the optimizer from a "
            f"list of parameters (e.g. lambda params: torch.optim.AdamW(params, lr=1e-4)), or None "
            f"for a forward-only model, got {type(optimizer_factory).__name__}")
    if not isinstance(plan, (str, Plan, ResolvedJob)):
        raise ValueError(f"amsp_ext.shard: plan must be a Plan, a string ('auto', 'zero3', "
                         f"'p=2x1,g=2x1,os=2x2', ...) or a ResolvedJob, got {type(plan).__name__}")
