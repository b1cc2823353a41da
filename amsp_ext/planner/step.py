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
* The root unit (embedding, final norm and lm_head: runtime/sync/units.py [Note: one root
  unit]) is gathered once, before the embedding, kept into the backward (no gather there) and
  reduce-scattered once after the embedding's backward, so with sp > 1 its gradients reach
  the all-reduce buckets last. The compute stays per module (embedding, final norm, lm_head).
* The step ends when compute and every stream are done, plus the optimizer step, which is
  memory-bound: (bytes touched per owned parameter) x Phi/sos / HBM bandwidth.
[Note: calibrated constants]
With a ``Calibration`` (calibration.py, the profile's ``calibration`` section, measured by
``amsp tune``) the free constants above are replaced by measured ones: forward and backward
FLOP/s of this model on this device instead of peak x efficiency, the optimizer's measured
bytes/s instead of the HBM bandwidth, a fixed per-step overhead, a per-kind factor on the
profile's collective times, and a per-kind overlap share o_k in [0, 1]. A kind-k collective of
time d then occupies the compute thread for (1 - o_k) d when it is issued and completes d after
issue, so o_k = 1 is the rule above and o_k = 0 a blocking collective:
* AG: unit u+1 starts at max(start_u + c_u + (1 - o) g_{u+1}, start_u + g_{u+1}) (prefetched);
* RS: each backward task is longer by (1 - o) r_u; the reduce-scatter stream runs as above;
* AR: the compute of a micro-batch is longer by (1 - o) x its buckets' time;
* BC: the first forward starts after (1 - o) T1_os; each unit still waits for its broadcasts.
The calibrated model also follows two rules of the engine (grad_sync.py) that the paper's
description leaves out: a backward pass ends only when its all-reduce buckets (and
reduce-scatters) are complete, so they never run into the next micro-batch or the optimizer
step; and at most ``ar_buckets_in_flight`` x U bytes are in flight, so launching a bucket first
waits, on the backward thread, for the oldest ones (planner/buckets.py [Note: bytes in flight]). Both
matter when the all-reduces are slower than the backward (a CPU cluster), not on the paper's
testbed.
Without a calibration the uncalibrated constants (and o_k = 1) are used, as before.

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

from amsp_ext.planner.calibration import KINDS, Calibration
from amsp_ext.planner.cost import CommCost
from amsp_ext.planner.issued import (
    broadcast_items,
    bucket_close_bytes,
    grad_buckets,
    root_tasks,
    unit_gathers,
)
from amsp_ext.planner.memory import grad_bytes, param_bytes
from amsp_ext.planner.model_spec import ModelSpec
from amsp_ext.planner.plan import Plan
from amsp_ext.planner.profile import CommTimer
from amsp_ext.planner.specs import ClusterSpec, TrainingSpec
from amsp_ext.planner.tensor_parallel import TPComm

__all__ = [
    "DEFAULT_EFFICIENCY",
    "Issued",
    "KindTimes",
    "issued_profile_times",
    "kind_times",
    "OverlapRules",
    "StepEstimate",
    "model_flops_per_token",
    "forward_flops_per_token",
    "optimizer_step_time",
    "optimizer_traffic_bytes",
    "step_estimate",
]

DEFAULT_EFFICIENCY = 0.65

# Bytes read + written per owned parameter by one optimizer step (grad, master, states, bf16 copy).
_OPT_TRAFFIC = {
    ("adamw", True): 30, ("sgd-momentum", True): 22, ("lion", True): 22, ("adam8bit", True): 18,
    ("adamw", False): 28, ("sgd-momentum", False): 20, ("lion", False): 20, ("adam8bit", False): 16,
    # the memory traffic only: Muon's Newton-Schulz FLOPs (5 iterations of 3 matmuls per matrix)
    # are not priced; Adafactor reads the gradient twice (its row and column means)
    ("muon", True): 22, ("muon", False): 20, ("adafactor", True): 18, ("adafactor", False): 16,
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
    tp_comm_s: float = 0.0  # tensor parallelism's all-reduces, all on the critical path

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


def forward_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs per token (a third of the training count): what a calibration's
    ``forward_flops_per_s`` divides; the backward does twice as many."""
    return model_flops_per_token(spec, seq_len) / 3.0


def optimizer_traffic_bytes(spec: ModelSpec, plan: Plan, training: TrainingSpec) -> float:
    """Bytes one rank's optimizer step reads and writes (its Phi / sos owned parameters)."""
    mixed = training.precision != "fp32"
    return _OPT_TRAFFIC[(training.optimizer, mixed)] * spec.num_params / plan.sos


def optimizer_step_time(spec: ModelSpec, plan: Plan, training: TrainingSpec,
                        cluster: ClusterSpec, calibration: Calibration | None = None) -> float:
    bandwidth = calibration.optimizer_bytes_per_s if calibration else cluster.memory_bandwidth
    return optimizer_traffic_bytes(spec, plan, training) / bandwidth


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


def _gated_forward(c: list[float], g: list[float], h: list[float], bc_end: list[float], *,
                   sharded: bool, blocking: bool, t0: float = 0.0) -> float:
    """End of the first forward of a step that starts computing at ``t0``: unit u (or, when
    sharded, its gather) waits for its own broadcasts to end at ``bc_end[u]``; gathers are
    prefetched one unit ahead and each takes ``h[u]`` of the compute thread (``blocking``: no
    prefetch, each issued when the unit before ends)."""
    start, ag_end, prev_c, s_prev = t0, 0.0, 0.0, None
    for u in range(len(c)):
        ready = t0 if s_prev is None else s_prev + prev_c
        if sharded:
            if s_prev is None:
                issue = max(t0, bc_end[u])
            elif not blocking:
                issue = max(s_prev, bc_end[u])
                ready += h[u]
            else:
                issue = max(ready, bc_end[u])
            ag_end = max(issue, ag_end) + g[u]
            start = max(ready, ag_end)
        else:
            start = max(ready, bc_end[u])
        s_prev, prev_c = start, c[u]
    return start + prev_c


def _chain(c: np.ndarray, g: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Start times of tasks with compute ``c`` that each need gather ``g`` first; the gather of
    task k+1 is issued when task k starts (prefetch depth 1) and takes ``h[k+1]`` of the compute
    thread (h = 0: a stream of its own; h = g: a gather issued when task k ends)."""
    steps = np.maximum(c[:-1] + h[1:], g[1:])
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


def _paper_micro_batches(M: int, *, first_fwd: float, fwd: float, bwd: float,
                         b_ready: np.ndarray, b_bytes: np.ndarray, U: int, t_ar_g: float,
                         t_ar_last: float, ar_overlap: float,
                         rs: tuple[np.ndarray, np.ndarray] | None) -> tuple[float, float, float]:
    """The paper's rules: micro-batches back to back on the compute thread; reduce-scatters and
    all-reduce buckets on streams of their own, unbounded, that may run past the backward into
    the next micro-batch. (compute end, reduce-scatter stream end, all-reduce stream end)."""
    compute_mb = fwd + bwd  # compute chain of one micro-batch (gathers on the critical path incl.)
    first_mb = first_fwd + bwd
    offsets = first_mb - compute_mb + compute_mb * np.arange(M)  # start of each micro-batch
    compute_end = first_mb + compute_mb * (M - 1)
    bwd_starts = offsets + fwd  # offsets[0] + fwd == first_fwd
    rs_tail = 0.0
    if rs is not None:
        done, r_bwd = rs
        rs_ready = (bwd_starts[:, None] + done[None, :]).ravel()
        rs_tail = _stream_end(rs_ready, np.tile(r_bwd, M))
    ar_ready, ar_dur = [], []
    for m in range(M):
        t_full = t_ar_last if m == M - 1 else t_ar_g
        if t_full <= 0:
            continue
        ar_ready.append(bwd_starts[m] + b_ready)
        ar_dur.append(t_full * b_bytes / U)
    ar_tail = 0.0
    if ar_ready:
        ready = np.concatenate(ar_ready)
        dur = np.concatenate(ar_dur)
        # the all-reduces' share of the compute thread (all of it when blocking: each
        # micro-batch's all-reduces then run after its backward)
        compute_end += (1.0 - ar_overlap) * float(dur.sum())
        if ar_overlap > 0:
            ar_tail = _stream_end(ready, dur)
    return float(compute_end), rs_tail, ar_tail


def _engine_micro_batches(M: int, *, first_fwd: float, fwd: float, bwd: float,
                          b_ready: np.ndarray, b_bytes: np.ndarray, ar: list[np.ndarray],
                          max_in_flight: float | None,
                          rs: tuple[np.ndarray, np.ndarray] | None) -> float:
    """The engine's own sequencing (calibrated model, see [Note: calibrated constants]): a
    backward pass ends only when its buckets' all-reduces (and reduce-scatters) are complete
    (grad_sync's end-of-backward flush), and launching bucket k first waits, on the backward
    thread, for the oldest buckets until those still in flight plus k hold at most
    ``max_in_flight`` bytes (None: no limit). ``b_bytes``: each bucket's bytes; ``ar[m]``:
    (duration, compute-thread time) of each bucket of micro-batch m, in launch order. Returns
    the end of the last micro-batch."""
    t = 0.0
    for m in range(M):
        bwd_start = t + (first_fwd if m == 0 else fwd)
        dur, cost = (ar[m][:, 0], ar[m][:, 1]) if len(ar[m]) else (np.zeros(0), np.zeros(0))
        delay, ends = 0.0, []  # delay: backward-thread time lost to the all-reduces so far
        oldest, window = 0, 0.0  # the oldest bucket that may still be in flight; bytes oldest..k
        for k in range(len(dur) if dur.sum() > 0 else 0):
            launch = bwd_start + b_ready[k] + delay
            window += float(b_bytes[k])
            if max_in_flight is not None:
                while oldest < k and window > max_in_flight:
                    window -= float(b_bytes[oldest])
                    oldest += 1  # bucket oldest - 1 must complete first (they end in order)
                if oldest > 0 and ends[oldest - 1] > launch:
                    delay += ends[oldest - 1] - launch
                    launch = ends[oldest - 1]
            ends.append(max(launch, ends[-1] if ends else launch) + dur[k])
            delay += cost[k]  # its time on the thread, right at launch
        end = bwd_start + bwd + delay
        if ends:
            end = max(end, ends[-1])
        if rs is not None:
            issue, r_bwd = rs
            end = max(end, _stream_end(bwd_start + issue, r_bwd))
        t = end
    return t


@dataclass(frozen=True)
class _Pricer:
    """(duration, compute-thread time) of one collective: the profile's time, or with a
    calibration its time under load (scale x profile + bytes x s_per_byte + latency) and the
    compute time it costs (bytes x compute_s_per_byte, at most its duration). A collective
    whose overlap is switched off costs the thread its whole duration; ``drop`` prices a kind
    at zero (``kind_times``)."""

    timer: CommTimer
    calibration: Calibration | None
    on: dict
    drop: str | None = None

    def __call__(self, kind: str, op: str, nbytes: float, mesh: tuple[int, int]
                 ) -> tuple[float, float]:
        t = self.timer.time(op, nbytes, *mesh)
        if t <= 0 or kind == self.drop:
            return 0.0, 0.0
        cal = self.calibration
        if cal is None:
            return t, (0.0 if self.on[kind] else t)
        count, moved = self.timer.issued(op, nbytes, *mesh)
        d = cal.under_load(kind, t, count, moved)
        if not self.on[kind] or kind in cal.blocking:
            return d, d
        return d, min(d, cal.compute_s_per_byte[kind] * moved)


def _switches(overlap: OverlapRules) -> dict[str, bool]:
    return {"AG": overlap.ag_rs, "RS": overlap.rs_async, "AR": overlap.ar, "BC": overlap.bc}


def step_estimate(
    plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
    timer: CommTimer, comm: CommCost, *, num_micro_batches: int,
    efficiency: float = DEFAULT_EFFICIENCY, overlap: OverlapRules = OverlapRules(),
    bwd_gather_mesh: tuple[int, int] | None = None, calibration: Calibration | None = None,
    drop_kind: str | None = None, tensor_parallel: TPComm | None = None,
) -> StepEstimate:
    """Time one step of ``plan`` (see the module notes). ``comm`` supplies T0_os and T1_os.
    ``bwd_gather_mesh`` gathers for backward on another mesh (ZeRO++'s secondary shard).
    ``calibration`` replaces the free constants by measured ones ([Note: calibrated constants]);
    ``drop_kind`` (AG, RS, AR or BC) prices that kind's collectives at zero (``kind_times``).
    ``tensor_parallel``: the TP all-reduces of a job whose ``spec`` is one TP rank's shard
    ([Note: tensor parallelism on the compute thread])."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    M = num_micro_batches
    params, flops, layer_of = _units(spec, training.seq_len, training.granularity)
    on = _switches(overlap)
    price = _Pricer(timer, calibration, on, drop_kind)
    c_f, c_b = _compute_times(training.tokens_per_micro_batch * flops, cluster, calibration, efficiency)
    compute = M * (c_f.sum() + c_b.sum())
    if training.recompute:
        compute += M * c_f[layer_of >= 0].sum()
    compute = float(compute)
    tp_s = 0.0
    if tensor_parallel is not None and tensor_parallel.degree > 1:
        tp_f, tp_b = _tp_unit_times(spec, training.granularity, tensor_parallel)
        c_f, c_b = c_f + tp_f, c_b + tp_b
        tp_s = M * tensor_parallel.per_micro_batch_s
    unit = _unit_collectives(price, spec, plan, training, bwd_gather_mesh)
    t1_os, h1_os, bc_end = _broadcast_schedule(price, params, plan, spec, training, comm, calibration,
                                               on, drop_kind)
    fwd, first_fwd = _first_forward(plan, c_f, unit, t1_os, h1_os, bc_end, on)
    bwd = _backward(plan, training, layer_of, c_f, c_b, unit, on, calibration)
    compute_end, rs_tail, ar_tail = _micro_batches(
        plan, spec, training, cluster, timer, comm, price, calibration, drop_kind, on, params,
        unit, bwd, M=M, fwd=fwd, first_fwd=first_fwd)

    t_opt = optimizer_step_time(spec, plan, training, cluster, calibration)
    overhead = calibration.step_overhead_s if calibration else 0.0
    # the whole-tensor exchange runs inside the optimizer step (cost.py [Note: the whole-tensor exchange])
    step = float(max(compute_end, rs_tail, ar_tail) + t_opt + comm.t_wt + overhead)
    if training.frozen_models:  # specs.py [Note: frozen models]: their forwards, each gather under its compute
        frozen_fwd = training.frozen_models * M * float(c_f.sum())
        compute += frozen_fwd
        step += max(frozen_fwd, comm.t_frozen)
    tokens = M * training.tokens_per_micro_batch
    useful = model_flops_per_token(spec, training.seq_len) * tokens
    peak = cluster.peak_flops
    return StepEstimate(
        step_s=step,
        compute_s=compute,
        optimizer_s=t_opt,
        exposed_comm_s=max(0.0, step - compute - tp_s - t_opt - overhead),
        mfu=useful / (step * peak),
        tokens_per_gpu_per_s=tokens / step / (tensor_parallel.degree if tensor_parallel else 1),
        efficiency=useful / (compute * peak) if calibration else efficiency,
        tp_comm_s=tp_s,
    )


def _tp_unit_times(spec: ModelSpec, granularity: str, tp: TPComm) -> tuple[np.ndarray, np.ndarray]:
    """[Note: tensor parallelism on the compute thread]
    Per unit of ``_units`` (forward order), the seconds of TP all-reduces its forward and its
    backward wait for (tensor_parallel.py): each all-reduce's result is the next operator's
    input, so it is added to its unit's compute task and nothing overlaps it; AMSP's gathers
    and reduce-scatters still run on their own streams beside it. A layer's forward all-reduces
    follow o and down (the row-parallel outputs), its backward ones q and gate (the last of the
    column-parallel inputs' gradients in backward order); the recompute forward re-runs the
    forward's. None outside the layers: the engine keeps the embedding, lm_head and the loss
    whole on every TP rank. Summed over a micro-batch this is ``tp.per_micro_batch_s``."""
    a = tp.activation_s
    if granularity == "layer":
        fwd_layer, bwd_layer = [2 * a], [2 * a]
    else:
        kinds = [k for k, _ in spec.layer_units(granularity)]
        fwd_layer = [a if k in ("o", "down") else 0.0 for k in kinds]
        bwd_layer = [a if k in ("q", "gate") else 0.0 for k in kinds]
    n_out = len(spec.outside_params())
    fwd = [0.0] + fwd_layer * spec.num_layers + [0.0] * (n_out - 1)
    bwd = [0.0] + bwd_layer * spec.num_layers + [0.0] * (n_out - 1)
    return np.asarray(fwd), np.asarray(bwd)


def _compute_times(flops_per_unit: np.ndarray, cluster: ClusterSpec, calibration: Calibration | None,
                   efficiency: float) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds of each unit in one micro-batch."""
    if calibration is not None:
        return (flops_per_unit / calibration.forward_flops_per_s,
                2.0 * flops_per_unit / calibration.backward_flops_per_s)
    c_f = flops_per_unit / (cluster.peak_flops * efficiency)
    return c_f, 2.0 * c_f


@dataclass(frozen=True)
class _UnitCollectives:
    """Per unit: (duration, time on the compute thread) of its forward all-gather (g, hg), its
    backward all-gather (g_b, hg_b, on ``bwd_gather_mesh``) and its reduce-scatter (r, hr)."""

    g: np.ndarray
    hg: np.ndarray
    g_b: np.ndarray
    hg_b: np.ndarray
    r: np.ndarray
    hr: np.ndarray


def _unit_collectives(price, spec: ModelSpec, plan: Plan, training: TrainingSpec,
                      bwd_gather_mesh: tuple[int, int] | None) -> _UnitCollectives:
    """Per task, its collectives as the engine issues them (issued.py ``unit_gathers``: the root
    unit gathered once before the embedding, not again in backward, reduce-scattered once after
    the embedding's backward); a task with none gets zeros."""
    e, e_g = param_bytes(training.precision), grad_bytes(training)
    p_mesh = plan.mesh("p")
    q_mesh = bwd_gather_mesh or p_mesh
    fwd, bwd, red = unit_gathers(spec, training.granularity)
    cache: dict = {}

    def priced(kind, op, nbytes, mesh):
        if nbytes <= 0:
            return 0.0, 0.0
        key = (kind, op, nbytes, mesh)
        if key not in cache:  # one price per distinct unit size
            cache[key] = price(kind, op, nbytes, mesh)
        return cache[key]

    ag = [priced("AG", "allgather", e * n, p_mesh) for n in fwd]
    ag_b = [priced("AG", "allgather", e * n, q_mesh) for n in bwd]
    rs = [priced("RS", "reducescatter", e_g * n, p_mesh) for n in red]

    def col(table, i):
        return np.array([t[i] for t in table])

    return _UnitCollectives(g=col(ag, 0), hg=col(ag, 1), g_b=col(ag_b, 0), hg_b=col(ag_b, 1),
                            r=col(rs, 0), hr=col(rs, 1))


def _broadcast_schedule(price, params: np.ndarray, plan: Plan, spec: ModelSpec,
                        training: TrainingSpec, comm: CommCost, calibration: Calibration | None,
                        on: dict, drop_kind: str | None) -> tuple[float, float, np.ndarray]:
    """(T1_os, its time on the compute thread, when each unit's updated parameters arrive)."""
    if calibration is None:  # the paper's T1_os, spread over the units in proportion to bytes
        t1_os = 0.0 if drop_kind == "BC" else comm.t1_os
        h1_os = 0.0 if on["BC"] else t1_os
        return t1_os, h1_os, np.cumsum(t1_os * params / params.sum())
    # the engine's broadcasts, one by one (issued.py), in forward order
    items = broadcast_items(spec, plan, granularity=training.granularity,
                            bucket_bytes=training.bucket_bytes, elem_bytes=param_bytes(training.precision))
    priced = [price("BC", "broadcast", b, plan.bcast_mesh()) for b, _ in items]
    bc_end = np.zeros(len(params))
    done_at = 0.0
    for (_, unit), (d, _) in zip(items, priced):
        done_at += d
        bc_end[unit] = done_at
    return (float(sum(d for d, _ in priced)), float(sum(h for _, h in priced)),
            np.maximum.accumulate(bc_end))


def _first_forward(plan: Plan, c_f: np.ndarray, unit: _UnitCollectives, t1_os: float, h1_os: float,
                   bc_end: np.ndarray, on: dict) -> tuple[float, float]:
    """(a forward, the step's first forward: gated by the broadcasts of updated parameters)."""
    s = _chain(c_f, unit.g, unit.hg)
    fwd = s[-1] + c_f[-1]
    if t1_os <= 0:
        return fwd, fwd
    t0 = h1_os  # the broadcasts' time on the compute thread, right after the step
    if plan.sp > 1:
        return fwd, _gated_forward(c_f.tolist(), unit.g.tolist(), unit.hg.tolist(), bc_end.tolist(),
                                   sharded=True, blocking=not on["AG"], t0=t0)
    # start_u = max(start_{u-1} + c_{u-1}, bc_end_u), solved in closed form
    c_before = t0 + np.concatenate(([0.0], np.cumsum(c_f)[:-1]))
    starts = c_before + np.maximum.accumulate(np.maximum(bc_end - c_before, 0.0))
    return fwd, float(starts[-1] + c_f[-1])


@dataclass(frozen=True)
class _Backward:
    """One micro-batch's backward: its length, when each unit's gradient is computed (``done``,
    backward order of ``units``), when its reduce-scatter is issued and when it is ready for
    the all-reduce buckets."""

    seconds: float
    done: np.ndarray
    units: np.ndarray
    rs_async: bool
    rs_issue: np.ndarray
    grad_ready: np.ndarray


def _backward(plan: Plan, training: TrainingSpec, layer_of: np.ndarray, c_f: np.ndarray,
              c_b: np.ndarray, unit: _UnitCollectives, on: dict,
              calibration: Calibration | None) -> _Backward:
    order, is_bwd, need_gather = _backward_order(tuple(layer_of.tolist()), training.recompute)
    tc = np.where(is_bwd, c_b[order], c_f[order])
    tg = np.where(need_gather, unit.g_b[order], 0.0)
    th = np.where(need_gather, unit.hg_b[order], 0.0)
    if plan.sp > 1:  # a reduce-scatter's time on the compute thread (all of it when blocking)
        tc = tc + np.where(is_bwd, unit.hr[order], 0.0)
    bs = _chain(tc, tg, th)
    seconds = bs[-1] + tc[-1]
    if calibration is not None:
        seconds += calibration.micro_batch_overhead_s
    done = (bs + tc)[is_bwd]  # gradient of each unit computed (backward order)
    units = order[is_bwd]
    # a reduce-scatter is issued when its unit's gradient is computed, before its time on the
    # compute thread; calibrated, it always runs on a stream of its own (continuous in h)
    rs_async = plan.sp > 1 and (on["RS"] or calibration is not None)
    rs_issue = done - unit.hr[units] if plan.sp > 1 else done
    if rs_async:  # a bucket waits for its units' reduce-scatters
        d_cum = np.cumsum(unit.r[units])
        grad_ready = np.maximum.accumulate(rs_issue - (d_cum - unit.r[units])) + d_cum
    else:
        grad_ready = done
    return _Backward(seconds=seconds, done=done, units=units, rs_async=rs_async,
                     rs_issue=rs_issue, grad_ready=grad_ready)


def _gradient_arrival(bwd: _Backward, roots: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(tasks, when their gradients reach the buckets) in arrival order. ``roots``: the root
    unit's tasks when sp > 1, whose gradients all arrive with its one reduce-scatter, after the
    embedding's backward (runtime/sync/units.py [Note: one root unit]); empty when sp = 1."""
    if not roots:
        return bwd.units, bwd.grad_ready
    at = float(bwd.grad_ready[bwd.units.tolist().index(0)])
    keep = ~np.isin(bwd.units, roots)
    return (np.concatenate([bwd.units[keep], np.asarray(roots)]),
            np.concatenate([bwd.grad_ready[keep], np.full(len(roots), at)]))


def _micro_batches(plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
                   timer: CommTimer, comm: CommCost, price, calibration: Calibration | None,
                   drop_kind: str | None, on: dict, params: np.ndarray, unit: _UnitCollectives,
                   bwd: _Backward, *, M: int, fwd: float, first_fwd: float) -> tuple[float, float, float]:
    """(end of the last micro-batch's compute, reduce-scatter tail, all-reduce tail): the M
    micro-batches with their gradient all-reduce buckets."""
    g_mesh, U = plan.grad_mesh(), training.bucket_bytes
    rs = (bwd.done if calibration is None else bwd.rs_issue, unit.r[bwd.units]) if bwd.rs_async else None
    tasks, ready = _gradient_arrival(bwd, root_tasks(spec, training.granularity) if plan.sp > 1 else [])
    if calibration is None:
        unit_grad_bytes = grad_bytes(training) * params[tasks] / plan.sp
        b_ready, b_bytes = _bucket_ready(unit_grad_bytes, ready, U)
        t_ar_g, t_ar_last = 0.0, 0.0
        if drop_kind != "AR":
            t_ar_g = timer.time("allreduce", U, *g_mesh)
            t_ar_last = comm.t0_os / b_bytes.sum() * U if comm.t0_os > 0 else 0.0
        return _paper_micro_batches(
            M, first_fwd=first_fwd, fwd=fwd, bwd=bwd.seconds, b_ready=b_ready, b_bytes=b_bytes, U=U,
            t_ar_g=t_ar_g, t_ar_last=t_ar_last, ar_overlap=1.0 if on["AR"] else 0.0, rs=rs)
    # the engine's buckets (issued.py), each ready when its units' gradients are
    buckets = grad_buckets(spec, plan, granularity=training.granularity, bucket_bytes=U,
                           elem_bytes=grad_bytes(training), close_bytes=_close(timer, plan, training, cluster))
    ready_of = dict(zip(tasks.tolist(), ready.tolist()))
    b_ready = np.array([max(ready_of[u] for u in units) for _, units in buckets])
    replica = plan.replica_mesh(cluster.gpus_per_node, cluster.num_nodes)
    order_b = np.argsort(b_ready, kind="stable")
    last = np.array([price("AR", "allreduce", b, replica) for b, _ in buckets])[order_b]
    other = np.array([price("AR", "allreduce", b, g_mesh) for b, _ in buckets])[order_b]
    b_bytes = np.array([b for b, _ in buckets], dtype=float)[order_b]
    cap = calibration.ar_buckets_in_flight
    compute_end = _engine_micro_batches(
        M, first_fwd=first_fwd, fwd=fwd, bwd=bwd.seconds, b_ready=b_ready[order_b], b_bytes=b_bytes,
        ar=[last if m == M - 1 else other for m in range(M)],
        max_in_flight=None if cap is None else cap * _in_flight_unit(U, b_bytes, plan), rs=rs)
    return compute_end, 0.0, 0.0


def _close(timer: CommTimer, plan: Plan, training: TrainingSpec, cluster: ClusterSpec) -> int | None:
    """Where the engine's buckets close (issued.py bucket_close_bytes)."""
    return bucket_close_bytes(timer, plan, gpus_per_node=cluster.gpus_per_node, num_nodes=cluster.num_nodes,
                              bucket_bytes=training.bucket_bytes, given=training.bucket_close_bytes)


def _in_flight_unit(U: int, b_bytes: np.ndarray, plan: Plan) -> float:
    """What the in-flight cap counts in: U, or the largest bucket where a sharded unit larger
    than U is one bucket (planner/buckets.py in_flight_cap)."""
    return float(U) if plan.sp == 1 else max(float(U), float(b_bytes.max(initial=0.0)))


@dataclass(frozen=True, kw_only=True)
class KindTimes:
    """Per collective kind: the time the step model gives its collectives in one step
    (``busy_s``, no overlap) and what they add to the step (``exposed_s``: the step time minus
    the step time with that kind priced at zero)."""

    busy_s: dict[str, float]
    exposed_s: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class Issued:
    """The collectives of one kind the engine issues in one step: the profile's time for them
    (summed), how many, and their bytes (the trace's v: AG output, RS input, AR/BC buffer; a
    two-level all-reduce counts as its three collectives, ``CommTimer.issued``)."""

    time_s: float = 0.0
    count: int = 0
    nbytes: float = 0.0


def issued_profile_times(plan: Plan, spec: ModelSpec, training: TrainingSpec,
                         cluster: ClusterSpec, timer: CommTimer, *, num_micro_batches: int,
                         bwd_gather_mesh: tuple[int, int] | None = None) -> dict[str, Issued]:
    """Per kind, the collectives the engine issues in one step (issued.py) and the profile's
    time for them: what a calibration is fitted against."""
    M, U = num_micro_batches, training.bucket_bytes
    e, e_g = param_bytes(training.precision), grad_bytes(training)
    p_mesh = plan.mesh("p")
    out = {k: Issued() for k in KINDS}
    if plan.sp > 1:  # the engine's own units (issued.py unit_gathers): its count, its bytes
        q_mesh = bwd_gather_mesh or p_mesh
        fwd, bwd, red = unit_gathers(spec, training.granularity)
        gathers = [(n, p_mesh) for n in fwd if n > 0] + [(n, q_mesh) for n in bwd if n > 0]
        ag = sum(timer.time("allgather", e * n, *mesh) for n, mesh in gathers)
        rs = sum(timer.time("reducescatter", e_g * n, *p_mesh) for n in red if n > 0)
        out["AG"] = Issued(time_s=M * ag, count=M * len(gathers),
                           nbytes=M * e * sum(n for n, _ in gathers))
        out["RS"] = Issued(time_s=M * rs, count=M * sum(n > 0 for n in red), nbytes=M * e_g * sum(red))
    buckets = grad_buckets(spec, plan, granularity=training.granularity, bucket_bytes=U,
                           elem_bytes=e_g, close_bytes=_close(timer, plan, training, cluster))
    replica = plan.replica_mesh(cluster.gpus_per_node, cluster.num_nodes)
    t_ar, n_ar, v_ar = 0.0, 0, 0.0
    for mesh, times in ((replica, 1), (plan.grad_mesh(), M - 1)):
        if mesh[0] * mesh[1] > 1 and times > 0:
            for b, _ in buckets:
                count, moved = timer.issued("allreduce", b, *mesh)
                t_ar += times * timer.time("allreduce", b, *mesh)
                n_ar += times * count
                v_ar += times * moved
    out["AR"] = Issued(time_s=t_ar, count=n_ar, nbytes=v_ar)
    items = broadcast_items(spec, plan, granularity=training.granularity, bucket_bytes=U,
                            elem_bytes=e)
    out["BC"] = Issued(time_s=sum(timer.time("broadcast", b, *plan.bcast_mesh()) for b, _ in items),
                       count=len(items), nbytes=sum(b for b, _ in items))
    return out


def kind_times(
    plan: Plan, spec: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
    timer: CommTimer, comm: CommCost, *, num_micro_batches: int, step: StepEstimate,
    **options,
) -> KindTimes:
    """The model's per-kind times for ``plan`` (AG: forward + backward gathers, RS, AR: Tg +
    T0_os, BC: T1_os; calibrated: the engine's collectives at their time under load), to
    compare with a measured trace. ``options`` are ``step_estimate``'s (efficiency, overlap,
    calibration, bwd_gather_mesh)."""
    cal: Calibration | None = options.get("calibration")
    M = num_micro_batches
    if cal is not None:  # the engine's collectives, as the calibrated model prices them
        issued = issued_profile_times(plan, spec, training, cluster, timer, num_micro_batches=M,
                                      bwd_gather_mesh=options.get("bwd_gather_mesh"))
        busy = {k: cal.comm_time_scale[k] * i.time_s + cal.comm_s_per_byte[k] * i.nbytes
                + cal.comm_latency_s[k] * i.count for k, i in issued.items()}
        return KindTimes(busy_s=busy, exposed_s=_exposed(plan, spec, training, cluster, timer,
                                                         comm, M, step, busy, options))
    e, e_g = param_bytes(training.precision), grad_bytes(training)
    fwd, bwd, red = unit_gathers(spec, training.granularity)
    p0, p1 = plan.mesh("p")
    q0, q1 = options.get("bwd_gather_mesh") or (p0, p1)
    ag = (sum(timer.time("allgather", e * n, p0, p1) for n in fwd if n > 0)
          + sum(timer.time("allgather", e * n, q0, q1) for n in bwd if n > 0))
    rs = sum(timer.time("reducescatter", e_g * n, p0, p1) for n in red if n > 0)
    busy = {"AG": M * ag, "RS": M * rs, "AR": comm.t_g + comm.t0_os, "BC": comm.t1_os}
    return KindTimes(busy_s=busy, exposed_s=_exposed(plan, spec, training, cluster, timer, comm,
                                                     M, step, busy, options))


def _exposed(plan, spec, training, cluster, timer, comm, M, step, busy, options) -> dict[str, float]:
    exposed = {}
    for k in KINDS:
        if busy[k] <= 0:
            exposed[k] = 0.0
            continue
        without = step_estimate(plan, spec, training, cluster, timer, comm,
                                num_micro_batches=M, drop_kind=k, **options)
        exposed[k] = max(0.0, step.step_s - without.step_s)
    return exposed
