"""Communication time of one training step: Tp, Tg, T0_os and T1_os (paper Sec. IV-C, Eq. 1).

With M micro-batches, Phi_i the parameters of sharding unit i, Phi = sum_i Phi_i, e the bytes
of a parameter (2 in bf16/fp16 as in the paper, 4 in fp32), e_g the bytes of a gradient as it
is reduced (the reduce dtype's: 4 for reduce_dtype "fp32", else e as in the paper), U the
bucket size, and t(op, v, p0 x p1) from the profile (contention-aware, see profile.py):

    Tp    = M * sum_i [ 2 t(AG, e*Phi_i, s0_p x s1_p) + t(RS, e_g*Phi_i, s0_p x s1_p) ]
    Tg    = (M - 1) * e_g*Phi / (U*sp) * t(AR, U, (s0_g/s0_p) x (s1_g/s1_p))
    T0_os = e_g*Phi / (U*sp) * t(AR, U, (R/s0_p) x (N/s1_p))
    T1_os = (sos/sp) * t(BC, e*Phi/sos, (s0_os/s0_p) x (s1_os/s1_p))
    Twt   = 2 * t(RS, 4*Phi/sos, s0_p x s1_p)   (whole-tensor optimizers with sp > 1 only)
    Tfz   = F * M * sum_i t(AG, e*Phi_i, s0_p x s1_p)   (F frozen models, specs.py [Note:
                                                        frozen models])
    Tcomm = Tp + Tg + T0_os + T1_os + Twt + Tfz (+ Ttp, the tensor-parallel all-reduces of M
                                      micro-batches when the job runs TP inside the node,
                                      tensor_parallel.py)

[Note: the whole-tensor exchange]
A whole-tensor optimizer (Muon, Adafactor) on a plan with sp > 1 sends each rank's owned fp32
row-shard gradients to their whole owners and the new rows back: two all-to-alls in the
param_shard group (runtime/optim/whole_tensor.py), each rank sending (sp - 1)/sp of its
4*Phi/sos bytes, the traffic of a reduce-scatter of that buffer; they run inside the optimizer
step, so the step model adds them there, unhidden.

[Note: the units Tp sums over]
The paper writes Tp as M * L * sum over the K modules of a layer. The engine also shards the
parameters outside the layers (embedding, final norm, lm_head), as ONE root unit
(runtime/sync/units.py [Note: one root unit]), and Phi in the other three terms and in the
memory model counts them, so Tp sums over every unit the engine issues collectives for:
M * (L * sum over a layer's units of 2 AG + RS, + one AG and one RS of the root unit), from
issued.py ``unit_gathers``, the list the step model prices: each collective's latency is
counted as many times as the engine pays it. Without the root unit it is exactly the paper's
sum. The bucket counts e_g*Phi/(U*sp) are kept fractional, as in the paper.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from amsp_ext.planner.issued import unit_gathers
from amsp_ext.planner.memory import grad_bytes, param_bytes, whole_tensor_rows
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import TrainingSpec

__all__ = ["CommCost", "comm_cost", "param_gather_time"]


@dataclass(frozen=True, kw_only=True)
class CommCost:
    t_p: float
    t_g: float
    t0_os: float
    t1_os: float
    t_tp: float = 0.0  # tensor parallelism's all-reduces (tensor_parallel.py), 0 without TP
    t_wt: float = 0.0  # [Note: the whole-tensor exchange]; 0 for elementwise optimizers or sp = 1
    # the frozen models' forward all-gathers (specs.py [Note: frozen models]); 0 without them
    t_frozen: float = 0.0

    @property
    def total(self) -> float:
        return self.t_p + self.t_g + self.t0_os + self.t1_os + self.t_tp + self.t_wt + self.t_frozen

    def as_dict(self) -> dict[str, float]:
        return {"total": self.total, "t_p": self.t_p, "t_g": self.t_g, "t0_os": self.t0_os,
                "t1_os": self.t1_os, "t_tp": self.t_tp, "t_wt": self.t_wt, "t_frozen": self.t_frozen}


def param_gather_time(
    spec: ModelSpec, training: TrainingSpec, timer: CommTimer, mesh: tuple[int, int],
    *, num_gathers: int = 2, reduce_scatter: bool = True,
) -> float:
    """One micro-batch's gathers (the forward's; with ``num_gathers`` 2 the backward's too) and
    reduce-scatters on ``mesh``, over the engine's units ([Note: the units Tp sums over])."""
    p0, p1 = mesh
    if p0 * p1 == 1:
        return 0.0
    e, e_g = param_bytes(training.precision), grad_bytes(training)
    fwd, bwd, red = unit_gathers(spec, training.granularity)
    gathered = fwd + (bwd if num_gathers >= 2 else [])
    t = sum(timer.time("allgather", e * n, p0, p1) for n in gathered if n > 0)
    if reduce_scatter:
        t += sum(timer.time("reducescatter", e_g * n, p0, p1) for n in red if n > 0)
    return t


def comm_cost(
    plan: Plan, spec: ModelSpec, training: TrainingSpec, timer: CommTimer, *,
    gpus_per_node: int, num_nodes: int, num_micro_batches: int,
    t_p_per_micro_batch: float | None = None,
) -> CommCost:
    """The paper's four terms for ``plan`` (seconds per step). ``t_p_per_micro_batch`` may pass
    a cached ``param_gather_time`` of the plan's parameter mesh."""
    M, R, N = num_micro_batches, gpus_per_node, num_nodes
    e, e_g = param_bytes(training.precision), grad_bytes(training)
    U = training.bucket_bytes
    num_buckets = e_g * spec.num_params / (U * plan.sp)

    if t_p_per_micro_batch is None:
        t_p_per_micro_batch = param_gather_time(spec, training, timer, plan.mesh("p"))
    t_p = M * t_p_per_micro_batch
    g0, g1 = plan.grad_mesh()
    t_g = (M - 1) * num_buckets * timer.time("allreduce", U, g0, g1)
    r0, r1 = plan.replica_mesh(R, N)
    t0 = num_buckets * timer.time("allreduce", U, r0, r1)
    b0, b1 = plan.bcast_mesh()
    t1 = (plan.sos / plan.sp) * timer.time("broadcast", e * spec.num_params / plan.sos, b0, b1)
    t_wt = 0.0
    if whole_tensor_rows(training, plan):  # [Note: the whole-tensor exchange]
        t_wt = 2 * timer.time("reducescatter", 4 * spec.num_params / plan.sos, *plan.mesh("p"))
    t_frozen = 0.0
    if training.frozen_models:  # one forward gather per unit, no reduce-scatter, per micro-batch
        t_frozen = training.frozen_models * M * param_gather_time(
            spec, training, timer, plan.mesh("p"), num_gathers=1, reduce_scatter=False)
    return CommCost(t_p=t_p, t_g=t_g, t0_os=t0, t1_os=t1, t_wt=t_wt, t_frozen=t_frozen)
