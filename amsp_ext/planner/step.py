"""Step time, MFU and tokens/GPU/s of a plan: compute plus the communication left exposed.

The paper's objective (Eq. 1) is the raw communication time. ``--objective step`` estimates what
a training step actually takes when the engine overlaps as the paper describes (Sec. V), which
makes the objective depend on M and on how much compute there is to hide behind.

[Note: compute]
Model FLOPs per token follow the Megatron-LM formula the paper uses (Narayanan et al. 2021),
written per module so that it is exact for GQA and SwiGLU: forward = 2 * (weights of every
matmul, lm_head included) + 4 * s * q (attention scores and their product with V, *not* halved
for the causal mask, as the paper does), and training = 3 x forward. For GPT it reduces to
72 * B * s * L * h^2 * (1 + s/(6h) + V/(12 L h)). Time = FLOPs / (peak FLOP/s x efficiency).
Recomputation adds one more forward of every layer to the *time* but not to the useful FLOPs
(MFU). The default efficiency, 0.65, is the MFU the paper reaches where communication is hidden
(LLaMA-7B at 8 GPUs: 63-64%, Fig. 11; Table V, 64 GPUs, M = 8: 0.67); calibrate it by measuring.

[Note: the overlap rules (paper Sec. V), as timed here]
* AG/RS behind compute: the all-gather of unit u+1 is issued when unit u starts computing
  (prefetch depth 1) and runs on its own stream; unit u+1 starts when both unit u's compute and
  its own gather are done. Backward mirrors it in reverse order; each unit's reduce-scatter runs
  on another stream once its gradient is computed. With recomputation, a layer's units are
  gathered for the recompute forward and kept for its backward.
* AR behind backward: gradients (reduce-scattered shards when sp > 1) fill buckets of U bytes in
  backward order; a full bucket's all-reduce runs on its own stream. In the last micro-batch it is
  T0_os's all-reduce over the replica group; in the others it is Tg's (when sg > sp).
* BC behind the next forward: the broadcasts of updated parameters run in forward order from
  the start of the step; a unit (or, when sp > 1, its all-gather) waits for its own broadcasts.
* The step ends when compute and every stream are done, plus the optimizer step, which is
  memory-bound: (bytes touched per owned parameter) x Phi/sos / HBM bandwidth.
Streams are independent: two collectives that share links at the same moment are each timed at
their profiled speed (optimistic when both cross nodes; the contention *within* one shape is in
the profile lookup). Switching a rule off makes that collective blocking, as the paper's Table V
ablation does. Collective times are the same profile lookups as the communication terms; T0_os
and T1_os are split over buckets and units in proportion to bytes.

Pure Python + NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from amsp_ext.planner.cost import CommCost
from amsp_ext.planner.memory import grad_bytes, param_bytes
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec

__all__ = [
    "DEFAULT_EFFICIENCY",
    "OverlapRules",
    "StepEstimate",
    "model_flops_per_token",
    "optimizer_step_time",
    "step_estimate",
]

DEFAULT_EFFICIENCY = 0.65

# Bytes read + written per owned parameter by one optimizer step (grad, master, states, bf16 copy).
_OPT_TRAFFIC = {
    ("adamw", True): 30, ("sgd-momentum", True): 22, ("lion", True): 22, ("adam8bit", True): 18,
    ("adamw", False): 28, ("sgd-momentum", False): 20, ("lion", False): 20, ("adam8bit", False): 16,
}


@dataclass(frozen=True, kw_only=True)
class OverlapRules:
    """Which of the paper's overlaps the engine performs (all on by default; Table V ablation).

    ``ag_rs=False`` makes all-gathers and reduce-scatters blocking (Table V's rows).
    ``rs=False`` keeps the all-gather prefetch but makes each unit's reduce-scatter blocking,
    right after its backward: what the paper's Fig. 14 traces show DeepSpeed's stage-3 engines
    (ZeRO-3, ZeRO++, MiCS) do even with ``overlap_comm`` on. ``amsp simulate`` uses it to model
    those baselines; it is never the default.
    """

    ag_rs: bool = True
    ar: bool = True
    bc: bool = True
    rs: bool = True

    @property
    def rs_async(self) -> bool:
        return self.ag_rs and self.rs


@dataclass(frozen=True, kw_only=True)
class StepEstimate:
    step_s: float
    compute_s: float
    optimizer_s: float
    exposed_comm_s: float
    mfu: float
    tokens_per_gpu_per_s: float
    efficiency: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def _unit_flops(spec: ModelSpec, seq_len: int) -> tuple[list[float], list[float]]:
    """Forward FLOPs per token of one layer's units and of the outside units (forward order)."""
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    per_module = {
        "norms": 0.0, "q": 2.0 * h * q, "k": 2.0 * h * kv, "v": 2.0 * h * kv,
        "o": 2.0 * q * h + 4.0 * seq_len * q,  # attention core runs just before o_proj
        "gate": 2.0 * h * i, "up": 2.0 * h * i, "down": 2.0 * i * h,
    }
    outside = {"embedding": 0.0, "final_norm": 0.0, "lm_head": 2.0 * h * spec.vocab_size}
    return ([per_module[k] for k, _ in spec.layer_module_params()],
            [outside[k] for k, _ in spec.outside_params()])


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Useful training FLOPs per token (3 x forward; tied lm_head still does its matmul)."""
    layer, outside = _unit_flops(spec, seq_len)
    fwd = spec.num_layers * sum(layer) + sum(outside)
    if spec.tie_word_embeddings:
        fwd += 2.0 * spec.hidden_size * spec.vocab_size
    return 3.0 * fwd


def optimizer_step_time(spec: ModelSpec, plan: Plan, training: TrainingSpec,
                        cluster: ClusterSpec) -> float:
    mixed = training.precision != "fp32"
    traffic = _OPT_TRAFFIC[(training.optimizer, mixed)]
    return traffic * spec.num_params / plan.sos / cluster.memory_bandwidth


@lru_cache(maxsize=32)
def _units(spec: ModelSpec, seq_len: int, granularity: str
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-unit (params, forward FLOPs/token, layer index or -1) in forward order."""
    layer_flops, out_flops = _unit_flops(spec, seq_len)
    if granularity == "layer":
        layer_flops = [sum(layer_flops)]
    layer_params = [n for _, n in spec.layer_units(granularity)]
    outside = spec.outside_params()
    L = spec.num_layers
    params = [outside[0][1]] + layer_params * L + [n for _, n in outside[1:]]
    flops = [out_flops[0]] + layer_flops * L + out_flops[1:]
    if spec.tie_word_embeddings:
        flops[-1] += 2.0 * spec.hidden_size * spec.vocab_size  # final norm unit does the matmul
    layer_of = [-1] + [li for li in range(L) for _ in layer_params] + [-1] * (len(outside) - 1)
    return np.asarray(params, float), np.asarray(flops, float), np.asarray(layer_of)


@lru_cache(maxsize=32)
def _backward_order(layer_of: tuple[int, ...], recompute: bool
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward tasks in execution order: (unit, is a backward task, needs a gather first).

    With recomputation each layer runs a recompute forward of its units (gathered, and kept)
    and then their backward in reverse; units outside the layers are not recomputed."""
    n = len(layer_of)
    if not recompute:
        return np.arange(n)[::-1], np.ones(n, bool), np.ones(n, bool)
    lo = np.asarray(layer_of)
    order, is_bwd = [], []
    for u in range(n - 1, 0, -1):  # lm_head, final norm
        if lo[u] == -1:
            order.append(u), is_bwd.append(True)
    for li in range(int(lo.max()), -1, -1):
        units = np.nonzero(lo == li)[0].tolist()
        order += units + units[::-1]
        is_bwd += [False] * len(units) + [True] * len(units)
    order.append(0), is_bwd.append(True)
    order_a, bwd_a = np.asarray(order), np.asarray(is_bwd)
    need_gather = ~(bwd_a & (lo[order_a] >= 0))
    return order_a, bwd_a, need_gather


def _gated_forward(c: list[float], g: list[float], bc_end: list[float], *, sharded: bool,
                   prefetch: bool) -> float:
    """End of the first forward of a step: unit u (or, when sharded, its gather) waits for its
    own broadcasts to end at ``bc_end[u]``; gathers are prefetched one unit ahead."""
    start, ag_end, prev_c, s_prev = 0.0, 0.0, 0.0, None
    for u in range(len(c)):
        ready = 0.0 if s_prev is None else s_prev + prev_c
        if sharded:
            issue = bc_end[u] if s_prev is None else max(s_prev if prefetch else ready, bc_end[u])
            ag_end = max(issue, ag_end) + g[u]
            start = max(ready, ag_end)
        else:
            start = max(ready, bc_end[u])
        s_prev, prev_c = start, c[u]
    return start + prev_c


def _chain(c: np.ndarray, g: np.ndarray, overlap: bool) -> np.ndarray:
    """Start times of tasks with compute ``c`` that each need gather ``g`` first; the gather of
    task k+1 is issued when task k starts (prefetch depth 1) or, without overlap, when it ends."""
    if overlap:
        steps = np.maximum(c[:-1], g[1:])
    else:
        steps = c[:-1] + g[1:]
    return g[0] + np.concatenate(([0.0], np.cumsum(steps)))


def _stream_end(ready: np.ndarray, dur: np.ndarray) -> float:
    """Finish time of a FIFO stream: task k starts at max(ready_k, end_{k-1}) and lasts dur_k."""
    if ready.size == 0:
        return 0.0
    d_cum = np.cumsum(dur)
    end = np.maximum.accumulate(ready - (d_cum - dur)) + d_cum
    return float(end[-1])


def _bucket_ready(grad_bytes: np.ndarray, ready: np.ndarray, bucket: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Buckets of ``bucket`` bytes filled in order: (ready time, bytes) of each bucket."""
    cum = np.cumsum(grad_bytes)
    total = cum[-1]
    edges = np.arange(bucket, total, bucket)
    edges = np.append(edges, total)
    idx = np.searchsorted(cum, edges - 1e-6 * bucket, side="left")
    sizes = np.diff(np.concatenate(([0.0], edges)))
    return ready[np.minimum(idx, ready.size - 1)], sizes


def step_estimate(
    plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
    timer: CommTimer, comm: CommCost, *, num_micro_batches: int,
    efficiency: float = DEFAULT_EFFICIENCY, overlap: OverlapRules = OverlapRules(),
    bwd_gather_mesh: tuple[int, int] | None = None,
) -> StepEstimate:
    """Time one step of ``plan`` (see the module notes). ``comm`` supplies T0_os and T1_os.
    ``bwd_gather_mesh`` gathers for backward on another mesh (ZeRO++'s secondary shard)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    M, T = num_micro_batches, training.tokens_per_micro_batch
    e, e_g = param_bytes(training.precision), grad_bytes(training)
    params, flops, layer_of = _units(spec, training.seq_len, training.granularity)
    rate = cluster.peak_flops * efficiency
    c_f = T * flops / rate
    c_b = 2.0 * c_f

    p0, p1 = plan.mesh("p")
    q0, q1 = bwd_gather_mesh or (p0, p1)
    sizes = {n: None for n in params.tolist()}
    ag = {n: timer.time("allgather", e * n, p0, p1) for n in sizes}
    ag_b = {n: timer.time("allgather", e * n, q0, q1) for n in sizes}
    rs = {n: timer.time("reducescatter", e_g * n, p0, p1) for n in sizes}
    g = np.array([ag[n] for n in params.tolist()])
    g_b = np.array([ag_b[n] for n in params.tolist()])
    r = np.array([rs[n] for n in params.tolist()])
    phi = params.sum()

    # -- first forward of the step, gated by the broadcasts of updated parameters ------------
    s = _chain(c_f, g, overlap.ag_rs)
    fwd = s[-1] + c_f[-1]
    if comm.t1_os <= 0:
        first_fwd = fwd
    elif overlap.bc:
        bc_end = np.cumsum(comm.t1_os * params / phi)
        if plan.sp > 1:
            first_fwd = _gated_forward(c_f.tolist(), g.tolist(), bc_end.tolist(), sharded=True,
                                       prefetch=overlap.ag_rs)
        else:  # start_u = max(start_{u-1} + c_{u-1}, bc_end_u), solved in closed form
            c_before = np.concatenate(([0.0], np.cumsum(c_f)[:-1]))
            starts = c_before + np.maximum.accumulate(bc_end - c_before)
            first_fwd = float(starts[-1] + c_f[-1])
    else:
        first_fwd = comm.t1_os + fwd

    # -- backward: tasks in execution order -------------------------------------------------
    order, is_bwd, need_gather = _backward_order(tuple(layer_of.tolist()), training.recompute)
    tc = np.where(is_bwd, c_b[order], c_f[order])
    tg = np.where(need_gather, g_b[order], 0.0)
    if plan.sp > 1 and not overlap.rs_async:
        tc = tc + np.where(is_bwd, r[order], 0.0)  # blocking reduce-scatter
    bs = _chain(tc, tg, overlap.ag_rs)
    bwd = bs[-1] + tc[-1]
    done = (bs + tc)[is_bwd]  # gradient of each unit computed (backward order)
    units_bwd = order[is_bwd]
    if plan.sp > 1 and overlap.rs_async:  # a bucket waits for its units' reduce-scatters
        d_cum = np.cumsum(r[units_bwd])
        grad_ready = np.maximum.accumulate(done - (d_cum - r[units_bwd])) + d_cum
    else:
        grad_ready = done

    # -- all-reduce buckets -----------------------------------------------------------------
    unit_grad_bytes = e_g * params[units_bwd] / plan.sp
    U = training.bucket_bytes
    b_ready, b_bytes = _bucket_ready(unit_grad_bytes, grad_ready, U)
    g0, g1 = plan.grad_mesh()
    t_ar_g = timer.time("allreduce", U, g0, g1)
    t_ar_last = comm.t0_os / b_bytes.sum() * U if comm.t0_os > 0 else 0.0

    compute_mb = fwd + bwd  # compute chain of one micro-batch (gathers on the critical path incl.)
    first_mb = first_fwd + bwd
    offsets = first_mb - compute_mb + compute_mb * np.arange(M)  # start of each micro-batch
    compute_end = first_mb + compute_mb * (M - 1)

    bwd_starts = offsets + fwd  # offsets[0] + fwd == first_fwd
    rs_tail = 0.0
    if plan.sp > 1 and overlap.rs_async:
        rs_ready = (bwd_starts[:, None] + done[None, :]).ravel()
        rs_tail = _stream_end(rs_ready, np.tile(r[units_bwd], M))

    ar_ready, ar_dur = [], []
    for m in range(M):
        bwd_start = bwd_starts[m]
        last = m == M - 1
        t_full = t_ar_last if last else t_ar_g
        if t_full <= 0:
            continue
        ar_ready.append(bwd_start + b_ready)
        ar_dur.append(t_full * b_bytes / U)
    if ar_ready:
        ready = np.concatenate(ar_ready)
        dur = np.concatenate(ar_dur)
        if overlap.ar:
            ar_tail = _stream_end(ready, dur)
        else:  # blocking: each micro-batch's all-reduces run after its backward
            ar_tail = 0.0
            compute_end += float(dur.sum())
    else:
        ar_tail = 0.0

    t_opt = optimizer_step_time(spec, plan, training, cluster)
    step = max(compute_end, rs_tail, ar_tail) + t_opt
    compute = M * (c_f.sum() + c_b.sum())
    if training.recompute:
        compute += M * c_f[layer_of >= 0].sum()
    tokens = M * T
    useful = model_flops_per_token(spec, training.seq_len) * tokens
    step, compute = float(step), float(compute)
    return StepEstimate(
        step_s=step,
        compute_s=compute,
        optimizer_s=t_opt,
        exposed_comm_s=max(0.0, step - compute - t_opt),
        mfu=useful / (step * cluster.peak_flops),
        tokens_per_gpu_per_s=tokens / step,
        efficiency=efficiency,
    )
