"""Gradient path for sg and sos: bucketed async AllReduce launched from post-accumulate-grad
hooks, then select & drop. One mechanism for sp = 1 and sp > 1.

[Note: where the gradient is picked up]
A hook is registered with ``register_post_accumulate_grad_hook`` on every *local* parameter:
the plain parameter when sp = 1 (autograd's AccumulateGrad calls it), the FSDP2 sharded DTensor
when sp > 1 (FSDP2 calls ``_post_accumulate_grad_hooks`` right after it accumulates the
reduce-scatter output into ``.grad``). The hook copies the gradient into its slot of a bucket of
``U = grad_bucket_bytes`` and frees ``.grad``; a bucket whose slots are all filled launches an
async AllReduce. Buckets are laid out statically in backward order (reverse forward order),
closed at unit boundaries (planner/buckets.py [Note: buckets close at unit boundaries]), and
launched strictly in bucket order, so every rank issues the same collectives in the same order
even if hooks fire in a slightly different order. At most ``IN_FLIGHT_BUCKETS`` x U bytes
are in flight (planner/buckets.py [Note: bytes in flight]). With ``all_reduce="two_level"`` a group with
several ranks on each of several nodes runs each bucket's AllReduce as collectives.py's
three-phase chain ([Note: two-level all-reduce]; the bucket is padded to split over the node's
ranks), and every hook moves the chains in flight on to their cross-node phase.
The last, partial buckets (and slots of parameters that got no gradient, zero-filled) are
flushed by an end-of-backward callback (``queue_callback``), queued by the first hook of the
pass; for sp > 1 FSDP2's own final callback is queued earlier (at its root pre-backward), so
its last reduce-scatters land before our flush.

[Note: three modes of a backward pass]
- boundary (the last micro-batch): AllReduce over ``param_replica`` (T0_os); each rank adds the
  gradients it *kept* from earlier micro-batches into its slot first; after the reduce the
  owner keeps its owned tensors (divided by the data-parallel size) and drops the rest.
- non-boundary with sg > sp: AllReduce over ``grad`` (Tg); the keeper (see ownership.py)
  accumulates the reduced gradient, the others drop it.
- non-boundary with sg == sp: nothing is communicated; ``.grad`` accumulates locally (autograd
  for sp = 1, FSDP2's sharded-grad accumulation for sp > 1) and the boundary hook sees the sum.
  On CPU with sp > 1 the hooks keep that sum themselves (``kept``, added into the boundary's
  bucket), so ``.grad`` is None at every reduce-scatter and each can be left in flight
  (deferred_rs.py [Note: a reduce-scatter decoupled on CPU]).
The sum is exact: every micro-batch's gradient of every rank enters the final replica
AllReduce exactly once (directly, or through exactly one keeper per gradient group).

[Note: a model without an optimizer]
A model sharded with no optimizer (a reference, reward or teacher model beside the trained one)
keeps only its parameters, sharded as the plan's p factors say: no gradient buffers, no masters,
no optimizer state (engine.py builds it with no local tensors to reduce). Its forward runs as a
trained model's, in training mode too (DPO's reference runs inside the policy's step). A gradient
that reaches one of its parameters has nowhere to go: the hook on every parameter that
requires grad (the sharded one when sp > 1, where FSDP2 hands over its reduce-scattered
gradient) raises one line naming the model, instead of a gradient silently dropped.

[Note: accumulation across boundary passes]
``no_sync()`` only saves communication: a loop that runs several boundary backwards before
``step()`` (no ``no_sync`` at all, as most hand-written loops accumulate) gets their sum, as
under DDP and FSDP2. Each boundary pass reduces its own gradients, and select & drop adds them
into the owned gradient a previous pass left (``zero_grad`` and ``step``'s consumers clear it),
at the price of one replica AllReduce per micro-batch. A ``step()`` whose last backward ran
inside ``no_sync()`` would step gradients no rank reduced: it is refused in one line.

[Note: a parameter no backward reached]
One process steps only the parameters whose ``.grad`` is set: a parameter no micro-batch's
backward reached since ``zero_grad`` (a branch not taken, an idle expert, a vision tower on a
text-only batch) gets no weight decay and no moment update, under DDP and FSDP2 too. Its slot
is zero-filled here, so stepping it would move it (AdamW's moments carry on): 0.012 off one
process after 3 steps in tests/test_own_loop.py's case. So the boundary pass's last bucket
carries one more element per local tensor: 1 where this rank's hooks saw its gradient since
``zero_grad`` (``touched``), else 0; the replica all-reduce sums them with the gradients (no
collective of its own), and a tensor whose sum is 0 is dropped from ``owned`` (the optimizer
then skips it, ``.grad`` stays None). The last bucket launches only once every earlier one has,
so when it does every hook of the pass has fired. A rank whose hooks saw every tensor needs no
answer (the sum is at least its own 1) and reads nothing back; only a rank that missed some
reads the sums, one device-to-host copy on an accelerator. The planner does not charge the
flags' bytes (one element per tensor). With sp > 1 the ranks of a shard group must reach the
same parameters in a backward, as FSDP2 requires without us.

[Note: a backward that raised part-way]
A backward that raises (an out-of-memory, a hook's error) never runs the end-of-backward
callbacks: ours (``_flush``) nor FSDP2's. Left as it was, the next backward would find this
pass's half-filled buckets and FSDP2's half-finished state and train silently wrong (sp > 1:
the next step's parameters 0.4 off in tests/test_own_loop.py's case). Invariant: outside a
backward, ``mode`` is None and FSDP2 has no final callback queued (``fsdp_root``). So where
either is not (the next forward's pre-hooks, ``step``'s ``collect``, ``zero_grad``), the pass
was aborted: every collective it left in flight is waited for (each rank that raised at the
same point issued the same ones; a rank that did not is named by the group's timeout), its
buckets and queued reduce-scatters are dropped, and FSDP2's ``reset_iter_state`` resets its
own; the gradients its unsharded parameters hold (a unit whose reduce-scatter never ran, e.g.
the root's) are dropped too, which that reset leaves, or the next backward adds into them.
The gradients accumulated for the step are then partial, as FSDP2's reset also declares them:
``step()`` refuses in one line until ``zero_grad()``, so a loop that catches the error and
skips the batch trains as one process does. The pre-hooks are prepended, so the reset runs
before any FSDP2 pre-forward of the forward that finds it. Not detected: a second backward
through a retained graph right after the failed one, with no forward between them.

[Note: reduce dtype]
Buckets are allocated in ``reduce_dtype`` (ShardConfig.reduce_dtype), so a compute-dtype
gradient is upcast as it is copied into its slot, the AllReduce sums in that dtype, and what
is kept (Tg) and owned after the boundary stays in it. Under "fp32" with a 16-bit compute
dtype, the local mode (sg == sp) also accumulates in fp32: each hook adds ``.grad`` into an
fp32 copy it keeps and frees ``.grad``, instead of letting autograd (or FSDP2) sum 16-bit
gradients. So no sum of gradients across micro-batches or ranks is ever rounded to 16 bits;
the only 16-bit values are each rank's per-micro-batch gradient as autograd computed it (and,
for sp > 1, FSDP2's reduce-scatter output, reduced in fp32 and rounded once, param_shard.py).
The price: twice the bytes on the wire for Tg and T0_os, buckets of U bytes hold half the
elements, and kept gradients take 4 bytes per element (the planner charges all three, see
planner/cost.py and planner/memory.py). An fp16 reduction divides every contribution by the
data-parallel size before summing (fp16 sums overflow at 65504); the other dtypes divide once,
after the sum.

[Note: streams (GPU; CPU/gloo has none)]
FSDP2 calls the parameter's post-accumulate-grad hooks inside its reduce-scatter stream
context (``foreach_reduce`` runs them under ``stream(post_reduce_stream)``); for sp = 1
autograd calls them on the backward stream of the op. Allocating buckets and issuing the
AllReduce "wherever the hook happens to run" would put our buffers in FSDP2's stream pool and
order our collectives behind its reduce-scatters by accident. So every gradient operation of
this file runs on one side stream of its own (``self.stream``), entered explicitly: on entry
it waits for the hook's current stream (the gradient has been produced there), the gradient
is ``record_stream``-ed on it before ``.grad`` is dropped (its memory must not be reused
before our copy ran), the AllReduce is issued on it (collectives.all_reduce(stream=...)) and
select & drop run on it. Every tensor we keep (buckets, kept, owned) is therefore allocated
and last written on the side stream. At the end of backward the current stream waits for the
side stream, so the optimizer step and clipping (current stream) read finished gradients;
when they are freed (zero_grad) a reuse by the side stream is ordered after them because the
side stream's next use waits for the then-current stream first, which is ordered after the
step. On CPU ``self.stream`` is None and all of this is a no-op.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

from amsp_ext.planner.buckets import bucket_layout, in_flight_cap
from amsp_ext.runtime import _torch_compat as compat
from amsp_ext.runtime import collectives as C
from amsp_ext.runtime.optim.layout import LocalTensor
from amsp_ext.runtime.sync.deferred_rs import DeferredReduceScatters
from amsp_ext.runtime.sync.grad_exposure import GradExposure
from amsp_ext.topology.mesh import GroupHandle

__all__ = ["GradSync"]

@dataclass(kw_only=True)
class _Bucket:
    slots: list[tuple[int, int, int]] = field(default_factory=list)  # (tensor index, offset, numel)
    numel: int = 0


def _no_grad():
    """``torch.no_grad()`` where grad mode is on; a backward runs its hooks with it off (unless
    ``create_graph``), so the per-gradient hooks skip entering and leaving it."""
    return torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()


def _plan_buckets(tensors: Sequence[LocalTensor], bucket_bytes: int, elem_bytes: int,
                  split_units: bool = True, close_bytes: int | None = None) -> list[_Bucket]:
    """Buckets in backward order, as planner/buckets.py lays them out ([Note: buckets close at
    unit boundaries] and [Note: a sharded unit is one bucket] there), with each tensor's slot."""
    buckets = []
    for positions in bucket_layout([(t.unit, t.numel) for t in tensors], bucket_bytes=bucket_bytes,
                                   elem_bytes=elem_bytes, split_units=split_units,
                                   close_bytes=close_bytes):
        bucket = _Bucket()
        for pos in positions:
            t = tensors[pos]
            bucket.slots.append((t.index, bucket.numel, t.numel))
            bucket.numel += t.numel
        buckets.append(bucket)
    return buckets


class GradSync:
    def __init__(self, tensors: Sequence[LocalTensor], *, comm: C.CollectiveContext, rank: int,
                 dtype: torch.dtype,
                 device: torch.device, bucket_bytes: int, dp_size: int,
                 replica: GroupHandle, grad: GroupHandle, overlap: bool,
                 exposure: GradExposure, modules: Sequence[nn.Module],
                 reduce_dtype: torch.dtype | None = None, split_units: bool = True,
                 close_bytes: int | None = None, deferred: DeferredReduceScatters | None = None,
                 fold_verdict: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 refuse: tuple[Sequence[torch.Tensor], str] | None = None,
                 fsdp_root: nn.Module | None = None) -> None:
        """``exposure``: what ``.grad`` holds after a boundary backward (grad_exposure.py);
        ``modules``: the units' modules, whose forward pre-hooks take it off again. ``refuse``:
        a forward-only model's ``(parameters, message)``: a gradient reaching any of them
        raises the message ([Note: a model without an optimizer]). ``split_units``: False when
        sp > 1 (planner/buckets.py [Note: a sharded unit is one bucket]); ``close_bytes``: where
        a bucket closes at a unit boundary ([Note: where a bucket closes, from the link] there;
        None: the default). ``deferred``: the reduce-scatters FSDP2's call left in flight, whose
        gradients the hooks hold until they are waited for (deferred_rs.py [Note: a
        reduce-scatter decoupled on CPU]); its ``poll_modules`` are where, inside a unit's
        backward, the hooks look for the ones that have completed. ``fsdp_root``: the module
        FSDP2 shards as the root when sp > 1, whose state a backward that raised part-way
        leaves unfinished too ([Note: a backward that raised part-way])."""
        self.tensors = list(tensors)
        self.fsdp_root = fsdp_root
        self.aborted = False  # a backward raised part-way since the last zero_grad
        self.exposure, self.modules = exposure, list(modules)
        self.refuse = refuse
        self.deferred = deferred
        self.comm = comm
        self.rank, self.dtype, self.device = rank, dtype, device
        self.reduce_dtype = reduce_dtype or dtype  # see [Note: reduce dtype]
        self.dp_size = dp_size
        self.replica, self.grad = replica, grad  # the boundary's group and the others'
        self.overlap = overlap
        elem = torch.empty((), dtype=self.reduce_dtype).element_size()
        self.buckets = _plan_buckets(self.tensors, bucket_bytes, elem, split_units, close_bytes)
        # planner/buckets.py [Note: bytes in flight]
        largest = 0 if split_units else max((b.numel for b in self.buckets), default=0)
        self.max_in_flight_numel = in_flight_cap(bucket_bytes, elem, largest)
        self.slot_of = {idx: (b, off, n) for b, bk in enumerate(self.buckets) for idx, off, n in bk.slots}
        # per bucket: this rank owns every tensor in it (see [Note: a bucket this rank owns whole])
        self.owned_whole = [all(self.tensors[i].owner_rank == rank for i, _, _ in bk.slots)
                            for bk in self.buckets]
        # fp16 sums can overflow: divide each contribution before reducing; else divide once after
        self.predivide = self.reduce_dtype == torch.float16
        # local accumulation (sg == sp) in the reduce dtype when it is wider than the compute dtype
        self.upcast_local = self.reduce_dtype != dtype
        # the hooks keep the local sum themselves (not ``.grad``) when upcasting, and where FSDP2
        # would otherwise add into a ``.grad`` and so read a reduce-scatter left in flight
        # (deferred_rs.py [Note: a reduce-scatter decoupled on CPU])
        self.keep_local = self.upcast_local or deferred is not None
        # see [Note: streams]; None on CPU
        self.stream = torch.Stream(device=device) if device.type != "cpu" else None
        self.is_boundary = True  # set by the engine (no_sync / set_gradient_accumulation_boundary)
        self.owned: dict[int, torch.Tensor] = {}  # boundary result: owned tensors' averaged grads
        self.kept: dict[int, torch.Tensor] = {}  # Tg result: kept grads, accumulated
        # given where the gradient norm is not all-reduced: NaN if this rank's loss was
        # non-finite, else its argument itself (optim/nonfinite.py [Note: one decision, on the
        # norm all-reduce]); applied to the first element of the boundary's first bucket
        self.fold_verdict = fold_verdict
        # a backward inside no_sync() left gradients no rank reduced yet ([Note: accumulation
        # across boundary passes])
        self.pending_local = False
        # tensor indices whose gradient hook fired since zero_grad ([Note: a parameter no
        # backward reached])
        self.touched: set[int] = set()
        self._reset_pass()
        self._handles = []
        self.peak_grad_bytes = 0

    # -- hooks ---------------------------------------------------------------------------------
    def install(self) -> None:
        for t in self.tensors:
            self._handles.append(t.param.register_post_accumulate_grad_hook(self._make_hook(t.index)))
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._before_forward, prepend=True))
        for m in self.deferred.poll_modules if self.deferred is not None else ():
            self._handles.append(m.register_forward_hook(self._arm_poll))
        if self.refuse is not None:
            params, message = self.refuse

            def refuse(param: torch.Tensor) -> None:
                raise RuntimeError(message)
            self._handles += [p.register_post_accumulate_grad_hook(refuse) for p in params if p.requires_grad]

    @torch.compiler.disable  # param_sync.py [Note: hooks under torch.compile]
    def _before_forward(self, module, args) -> None:
        if self.mode is not None or self.fsdp_root is not None:
            self.recover()
        if self.exposure.active:  # grad_exposure.py: before any backward can add into them
            self.exposure.adopt(self.owned)
            self.exposure.release()

    def _arm_poll(self, module, args, output) -> None:
        """A tensor hook on ``output``: its gradient marks a point inside the unit's backward
        (deferred_rs.py [Note: a reduce-scatter decoupled on CPU]). Nothing under compile,
        where the hook would break the graph, or without grad."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._poll)

    def _poll(self, grad: torch.Tensor) -> None:
        if self.mode is not None and self.deferred:
            with compat.label("amsp::grad_hook::poll"):
                for held in self.deferred.ready():
                    self._take(held)

    def recover(self) -> None:
        """Clean up after a backward that raised part-way, if one did ([Note: a backward that
        raised part-way]); nothing inside a backward, where ``mode`` is set by design."""
        fsdp = self.fsdp_root is not None and compat.fsdp_backward_unfinished(self.fsdp_root)
        if (self.mode is None and not fsdp) or compat.in_backward():
            return
        with compat.label("amsp::grad_sync::recover"):
            C.issue_gathers(p for _, p in self.in_flight)  # [Note: two-level all-reduce]
            for _, pending in self.in_flight:
                C.wait(pending)
            if self.deferred is not None:
                self.deferred.wait_all()  # their held gradients are this pass's: dropped
            self._reset_pass()
            if fsdp:
                self.fsdp_root.reset_iter_state()
                compat.fsdp_drop_unsharded_grads(self.fsdp_root)
        self.aborted = True

    def collect(self) -> dict[int, torch.Tensor]:
        """The owned gradients as the loop left them, for ``step`` and the clip."""
        self.recover()
        if self.aborted:
            raise RuntimeError(
                "amsp: step() after a backward that raised part-way: this step's gradients are "
                "partial; call zero_grad() and run its micro-batches again")
        if self.pending_local:
            raise RuntimeError(
                "amsp: step() after a backward inside no_sync(): its gradients were never "
                "reduced; run the last micro-batch's backward outside no_sync()")
        self.exposure.adopt(self.owned)
        return self.owned

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad(index)
        return hook

    def _reset_pass(self) -> None:
        self.mode: str | None = None
        self.buffers: dict[int, torch.Tensor] = {}
        self.filled: dict[int, set[int]] = collections.defaultdict(set)
        self.ready = [False] * len(self.buckets)
        self.next_launch = 0
        self.in_flight: collections.deque = collections.deque()  # (bucket, pending), oldest first
        self.in_flight_numel = 0  # elements of the buckets in self.in_flight

    def _begin_pass(self) -> None:
        if self.is_boundary:
            self.mode = "replica"
        elif self.grad.size > 1:
            self.mode = "grad"
        else:
            self.mode = "local"
        compat.queue_backward_callback(self._flush)

    def _on_side_stream(self):
        """See [Note: streams]: run on our own stream, after whatever produced the gradient.
        On CPU a plain no-op context: it is entered in every gradient hook, where a generator
        context costs several microseconds more."""
        if self.stream is None:
            return contextlib.nullcontext()
        return self._side_stream()

    @contextlib.contextmanager
    def _side_stream(self):
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            yield

    def _take_grad(self, t: LocalTensor) -> torch.Tensor | None:
        grad = t.local_grad()
        if grad is not None and self.stream is not None:
            grad.record_stream(self.stream)  # read on our stream after .grad is dropped
        return grad

    def _on_grad(self, index: int) -> None:
        self.touched.add(index)
        if self.mode is None:
            self._begin_pass()
        if self.deferred:  # in flight: deferred_rs.py [Note: a reduce-scatter decoupled on CPU]
            for held in self.deferred.ready():
                self._take(held)
            if self.deferred.holds(self.tensors[index].local_grad(), index):
                return
        self._take(index)

    def _take(self, index: int) -> None:
        """Gradient ``index`` is final: into its bucket (or kept, in the local modes)."""
        if self.mode == "local":
            if self.keep_local:
                self._accumulate_local(index)
            return
        t = self.tensors[index]
        with (compat.label(f"amsp::grad_hook::{'param_replica' if self.mode == 'replica' else 'grad'}"),
              self._on_side_stream(), _no_grad()):
            b, off, n = self.slot_of[index]
            if index in self.filled[b]:
                raise RuntimeError(f"amsp: parameter {t.name} received two gradients in one backward pass")
            grad = self._take_grad(t)
            view = self._buffer(b)[off : off + n]
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad.reshape(-1))  # upcasts to the reduce dtype
                if self.predivide:
                    view.div_(self.dp_size)
            if self.mode == "replica" and index in self.kept:
                view.add_(self.kept.pop(index).reshape(-1))
            t.param.grad = None  # its content lives in the bucket now
            self.filled[b].add(index)
            if len(self.filled[b]) == len(self.buckets[b].slots):
                self.ready[b] = True
                self._launch_ready()
            self._advance_in_flight()

    def _advance_in_flight(self) -> None:
        """Move two-level all-reduces on to their cross-node phase, oldest first, stopping at the
        first that cannot move (collectives.py [Note: two-level all-reduce])."""
        if self._group().levels is None:  # flat all-reduces move on by themselves
            return
        for _, pending in self.in_flight:
            if not C.advance(pending):
                break

    def _accumulate_local(self, index: int) -> None:
        """Local mode: keep the running sum (in the reduce dtype where it is wider than the
        compute dtype; else the first gradient itself, which nothing else holds once ``.grad``
        is dropped)."""
        t = self.tensors[index]
        with compat.label("amsp::grad_hook::local"), self._on_side_stream(), _no_grad():
            grad = self._take_grad(t)
            if grad is None:
                return
            if self.predivide:  # as the boundary's bucket divides its own contribution
                grad = grad / self.dp_size
            prev = self.kept.get(index)
            if prev is None:
                self.kept[index] = grad.to(self.reduce_dtype, copy=True) if self.upcast_local else grad
            else:
                prev.add_(grad)
            t.param.grad = None

    def _group(self):
        return self.replica if self.mode == "replica" else self.grad

    def _buffer(self, b: int) -> torch.Tensor:
        buf = self.buffers.get(b)
        if buf is None:
            numel = self.buckets[b].numel + self._flags(b)
            levels = self._group().levels
            # a two-level all-reduce reduce-scatters the bucket over the node's ranks: pad it
            padded = numel if levels is None else -(-numel // levels[0].size) * levels[0].size
            buf = torch.empty(padded, dtype=self.reduce_dtype, device=self.device)
            if padded > numel:
                buf[numel:].zero_()
            self.buffers[b] = buf
        return buf

    def _flags(self, b: int) -> int:
        """Elements after bucket ``b``'s slots that carry which tensors got a gradient: one per
        local tensor in a boundary pass's last bucket ([Note: a parameter no backward reached])."""
        return len(self.tensors) if self.mode == "replica" and b == len(self.buckets) - 1 else 0

    def _flag_view(self, b: int, buf: torch.Tensor) -> torch.Tensor:
        """Those elements of bucket ``b``'s buffer ``buf`` (before a two-level padding)."""
        n = self.buckets[b].numel
        return buf[n : n + self._flags(b)]

    # -- collectives ---------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets) and self.ready[self.next_launch]:
            b = self.next_launch
            self.next_launch += 1
            while self.in_flight and self.in_flight_numel + self.buckets[b].numel > self.max_in_flight_numel:
                self._complete_oldest()
            group = self._group()
            if b == 0 and self.mode == "replica" and self.fold_verdict is not None:
                first = self.buffers[b][:1]  # NaN if this rank's loss was bad; else unchanged
                first.copy_(self.fold_verdict(first))
            if self._flags(b):  # [Note: a parameter no backward reached]
                flags = self._flag_view(b, self.buffers[b])
                if len(self.touched) == len(self.tensors):  # the usual case: no index to copy
                    flags.fill_(1)
                else:
                    flags.zero_()
                    flags[sorted(self.touched)] = 1
            pending = None
            if group.levels is not None:  # collectives.py [Note: two-level all-reduce]
                local, node = group.levels
                pending = C.all_reduce_two_level(self.comm, self.buffers[b], (local.pg, local.name),
                                                 (node.pg, node.name), stream=self.stream,
                                                 timeout=group.timeout)
            elif group.size > 1:
                pending = C.all_reduce(self.comm, self.buffers[b], group.pg, name=group.name,
                                       stream=self.stream, async_op=True, timeout=group.timeout)
            if self.overlap:
                self.in_flight.append((b, pending))
                self.in_flight_numel += self.buckets[b].numel
            else:
                self._complete(b, pending)

    def _complete_oldest(self) -> None:
        b, pending = self.in_flight.popleft()
        self.in_flight_numel -= self.buckets[b].numel
        self._complete(b, pending)

    # [Note: a bucket this rank owns whole]
    # Select & drop copies a rank's owned gradients out of the reduced bucket, so the bucket and
    # the rest of it can be freed. When the rank owns every tensor of the bucket (always when
    # sos = sp, as in the replicate plan), nothing is dropped: the bucket is divided in place and
    # its slices are the owned gradients, as DDP's ``gradient_as_bucket_view`` keeps them. That
    # saves an allocation and a pass over the bucket per step, and the bucket's bytes are held
    # once, not twice, while it is selected. The slices stay until ``zero_grad`` drops them.
    # No step-time change was measurable on the CPU lab (comparisons/results/design_history.md,
    # "Gradient bucket views and per-kind groups").
    def _complete(self, b: int, pending) -> None:
        C.wait(pending)  # with its group's timeout, given at issue
        buf = self.buffers.pop(b)
        with compat.label("amsp::select_and_drop"), torch.no_grad():
            whole = self.mode == "replica" and self.owned_whole[b]  # see the Note above
            if whole and not self.predivide:
                buf.div_(self.dp_size)
            for idx, off, n in self.buckets[b].slots:
                t = self.tensors[idx]
                view = buf[off : off + n].view(t.local_shape)
                if whole:
                    self._own(idx, view)
                elif self.mode == "replica":
                    if t.owner_rank == self.rank:
                        self._own(idx, view.clone() if self.predivide else view / self.dp_size)
                elif t.keeper_rank == self.rank:
                    prev = self.kept.get(idx)
                    self.kept[idx] = view.clone() if prev is None else prev.add_(view)
            if self._flags(b) and len(self.touched) < len(self.tensors):
                flags = self._flag_view(b, buf)
                for idx in (flags == 0).nonzero().flatten().tolist():  # no rank's hooks saw it
                    self.owned.pop(idx, None)
        # ``buf`` is dropped here: the non-owned gradients are released

    def _own(self, idx: int, grad: torch.Tensor) -> None:
        prev = self.owned.get(idx)  # [Note: accumulation across boundary passes]
        self.owned[idx] = grad if prev is None else prev.add_(grad)

    def _flush(self) -> None:
        """End of backward: launch what is left (zero-filling missing slots), wait for all."""
        if self.deferred is not None:
            for held in self.deferred.wait_all():
                self._take(held)
        if self.mode == "local":
            self.pending_local = True
            self._end_pass()
            return
        with compat.label("amsp::flush_buckets"), self._on_side_stream(), torch.no_grad():
            for b, bk in enumerate(self.buckets):
                if self.ready[b]:
                    continue
                missing = [(idx, off, n) for idx, off, n in bk.slots if idx not in self.filled[b]]
                buf = self._buffer(b)
                for idx, off, n in missing:
                    buf[off : off + n].zero_()
                    if self.mode == "replica" and idx in self.kept:
                        buf[off : off + n].add_(self.kept.pop(idx).reshape(-1))
                self.ready[b] = True
            self._launch_ready()
            C.issue_gathers(p for _, p in self.in_flight)  # [Note: two-level all-reduce]
            while self.in_flight:
                self._complete_oldest()
        if self.stream is not None:  # the step reads what the side stream produced
            torch.accelerator.current_stream(self.device).wait_stream(self.stream)
        self.pending_local = self.mode != "replica"  # a Tg pass left partial sums (kept)
        if self.mode == "replica":
            self.exposure.expose(self.owned)
        self._end_pass()

    def _end_pass(self) -> None:
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.grad_bytes())
        self._reset_pass()

    # -- state -----------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop owned and kept gradients; the parameters' ``.grad`` (only set in the local mode,
        between micro-batches) to None or, with ``set_to_none=False``, zeroed in place (an
        exposed ``.grad`` goes to None: the engine's gradient it showed is dropped)."""
        self.recover()
        self.aborted = False
        self.exposure.release()
        self.owned.clear()
        self.kept.clear()
        self.touched.clear()
        self.pending_local = False
        for t in self.tensors:
            if set_to_none or t.param.grad is None:
                t.param.grad = None
            else:
                t.param.grad.zero_()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradient storage held now: owned + kept + not-yet-reduced local ``.grad`` (no
        buckets); the dry run's memory tracker files these as gradients."""
        out = [*self.owned.values(), *self.kept.values()]
        for t in self.tensors:
            if self.exposure.is_exposed(t.index, t.param.grad):  # a view of ``owned``, or no storage
                continue
            g = t.local_grad()
            if g is not None:
                out.append(g)
        return out

    def grad_bytes(self) -> int:
        """Gradient bytes held now: owned + kept + not-yet-reduced local ``.grad`` (no buckets)."""
        return sum(g.numel() * g.element_size() for g in self.grad_tensors())
