"""The classic systems, costed with the same formulas as AMSP plans.

[Note: baselines as factor tuples]
DDP, ZeRO-1/2/3 and MiCS are AMSP plans (``plan.named_plan``): DDP (1,1,1); ZeRO-1 sos = dp;
ZeRO-2 sg = sos = dp; ZeRO-3 sp = sg = sos = dp; MiCS sp = sg = sos = K (its shard group, one
node by default), replicated across groups. They go through the same memory model, the same
Tp/Tg/T0_os/T1_os and the same step model. (Real ZeRO-1/2 redistribute updated parameters with
an all-gather rather than T1_os's per-owner broadcasts; the formulas are the paper's.)

ZeRO++ is not an AMSP plan: it is ZeRO-3 whose backward all-gathers read a secondary copy of the
parameters sharded inside an hpZ group (one node: 8 GPUs on the paper's cluster), with
quantisation off as in the paper. Per micro-batch and unit i:

    Tp(ZeRO++) = M * sum_i [ t(AG, e*Phi_i, dp) + t(AG, e*Phi_i, hpZ) + t(RS, e*Phi_i, dp) ]

(forward gathers over dp, backward over hpZ, reduce-scatter over dp), no Tg/T0_os/T1_os, and the
secondary shard adds e*Phi/hpZ bytes to the parameters.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from amsp_ext.planner.cost import param_gather_time
from amsp_ext.planner.plan import Plan, mesh_of_size, named_plan
from amsp_ext.planner.search import GiB, Candidate, Problem, evaluate
from amsp_ext.planner.memory import param_bytes
from amsp_ext.planner.step import step_estimate

__all__ = ["BASELINES", "Baseline", "baselines", "comparison"]

BASELINES = ("ddp", "zero1", "zero2", "zero3", "zero++", "mics")
_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
           "zero++": "ZeRO++", "mics": "MiCS"}


@dataclass(frozen=True, kw_only=True)
class Baseline:
    key: str
    label: str
    plan: Plan  # for ZeRO++: its primary (ZeRO-3) factors
    candidate: Candidate
    note: str = ""


def _zeropp(problem: Problem, hpz: int) -> Baseline:
    R, N = problem.cluster.gpus_per_node, problem.cluster.num_nodes
    spec, training, timer, M = problem.spec, problem.training, problem.timer, problem.num_micro_batches
    plan = named_plan("zero3", gpus_per_node=R, num_nodes=N)
    base = evaluate(problem, plan, with_step=False)
    hpz_mesh = mesh_of_size(hpz, R, N, "hpz_size")
    per_mb = (param_gather_time(spec, training, timer, plan.mesh("p"), num_gathers=1)
              + param_gather_time(spec, training, timer, hpz_mesh, num_gathers=1,
                                  reduce_scatter=False))
    comm = replace(base.comm, t_p=M * per_mb)
    secondary = int(param_bytes(training.precision) * spec.num_params / hpz)
    mem = replace(base.memory, params=base.memory.params + secondary)
    step = step_estimate(plan, spec, training, problem.cluster, timer, comm,
                         num_micro_batches=M, efficiency=problem.efficiency,
                         overlap=problem.overlap, bwd_gather_mesh=hpz_mesh,
                         calibration=problem.calibration, tensor_parallel=problem.tp_comm)
    growth = per_mb + (problem.tp_comm.per_micro_batch_s if problem.tp_comm else 0.0)
    cand = Candidate(plan=plan, comm=comm, memory=mem,
                     feasible=mem.total <= problem.memory_limit, growth_s=growth, step=step)
    return Baseline(key="zero++", label=f"ZeRO++ (hpZ {hpz})", plan=plan, candidate=cand,
                    note=f"ZeRO-3 + secondary parameter shard over {hpz_mesh[0]}x{hpz_mesh[1]}")


def baselines(problem: Problem, *, mics_size: int | None = None,
              hpz_size: int | None = None) -> list[Baseline]:
    """Every baseline of BASELINES on ``problem``'s cluster (MiCS and hpZ default to one node)."""
    R, N = problem.cluster.gpus_per_node, problem.cluster.num_nodes
    mics = mics_size or R
    hpz = min(hpz_size or R, R * N)
    out = []
    for key in BASELINES:
        if key == "zero++":
            out.append(_zeropp(problem, hpz))
            continue
        name = f"mics:{mics}" if key == "mics" else key
        plan = named_plan(name, gpus_per_node=R, num_nodes=N)
        label = f"MiCS ({mics})" if key == "mics" else _LABELS[key]
        out.append(Baseline(key=key, label=label, plan=plan,
                            candidate=evaluate(problem, plan, with_step=True)))
    return out


def comparison(chosen: Candidate, base: Baseline) -> str:
    """'vs ZeRO-3: 3.1x less communication, 12.4 GiB more memory per GPU'."""
    a, b = chosen.comm.total, base.candidate.comm.total
    if a > 0 and b > 0:
        ratio = b / a
        comm = (f"{ratio:.2f}x less communication" if ratio >= 1
                else f"{1 / ratio:.2f}x more communication")
    elif a == b:
        comm = "the same communication"
    else:
        comm = "no communication" if a == 0 else f"{a:.3f} s more communication"
    dm = (chosen.memory.total - base.candidate.memory.total) / GiB
    mem = f"{abs(dm):.1f} GiB {'more' if dm >= 0 else 'less'} memory per GPU"
    return f"vs {base.label}: {comm}, {mem}"
