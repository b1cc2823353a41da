"""Where one training step's time goes: every collective by kind and phase, from a torch.profiler
trace, the same way for every system (DDP, FSDP2, DeepSpeed, the AMSP engine).

[Note: one step's breakdown]
The runners label their step (``phase::step``) and its phases (``phase::forward``,
``phase::backward``, ``phase::optimizer``: clipping, step, zero_grad) with record_function
(systems/base.py ``phase``); the worker profiles 1 + ``trace_steps`` steps and this module
reads each after the first ([Note: the median profiled step]).
A collective is seen twice in a CPU/gloo trace: its *issue* on a training thread (the c10d
dispatcher op, ``c10d::allreduce_`` etc., short for async ones) and its *run* on one of the
process group's gloo worker threads (``gloo:all_reduce``, with the tensor's numel and dtype as
its input; gloo runs a reduce-scatter as ``gloo:all_reduce`` of the whole input). Runs are
matched to issues in order (gloo's queue is FIFO): each run takes the earliest unmatched issue
of a compatible op that began before it: the earliest with the run's numel, else (an issue
that records no shape) the earliest of unknown numel.

[Note: match by numel across process groups]
gloo's FIFO order holds per process group, and the trace does not say which group an issue or a
run belongs to; runs of two groups interleave (a two-level all-reduce: the in-node group
reduces bucket k+1 while the node group reduces bucket k's shard). Matched by order alone, a
node run took the in-node issue of the next bucket, the swapped labels moved a bucket between
the levels, and the gradient bytes of one rank's step came out one bucket high or low
(compare/wire.py counts the in-node level only). So every issue's numel is read where the
profiler keeps it: ``input_shapes`` for a tensor argument, ``structured_input_shapes`` for a
tensor list (``allreduce_``'s one tensor; ``input_shapes`` leaves a list empty). Order decides
only between issues of one numel, and an issue of unknown numel (a list of several tensors, or
a torch without ``structured_input_shapes``) is taken only where none of the run's numel is
waiting.

Per collective: ``issued`` (its issue's start), ``ended`` (its run's end): busy = ended - issued,
i.e. queueing behind earlier collectives of its group and waiting for the slowest rank count.
*compute* = union of ``aten::`` spans on the training threads minus the c10d issue spans;
*exposed* = busy time during which the training threads computed nothing (they waited, or ran
Python between ops: a slight over-statement); *overlapped* = busy time during which they
computed. Per (phase, kind): count, bytes, busy_s (union), exposed_s, overlapped_s and ``waits``:
what the training thread was inside while exposed (the innermost non-aten event: e.g.
``amsp::wait::all_reduce::param_replica``, ``FSDP::post_backward_reduce``, or ``(between
ops)``), with seconds. Phase = the phase the issue happened in; AMSP's parameter broadcasts
(issued inside ``amsp::broadcast_params``) are the phase ``post_step_broadcast``; the analysed
step counts the *previous* step's (which its forward waits for) instead of its own (which
complete in the next, unprofiled, step): the steady state of one step.

Kinds: AG, RS, AR, BC (as comm_trace.py); ``other`` = scalar collectives (AMSP's ``world`` and
``optim`` groups: clip norm, non-finite guard; DTensor's functional collectives: FSDP2's clip
norm; DDP's buffer broadcast in forward). Per-kind exposed times overlap when two kinds are in
flight at once; ``totals.exposed_s`` counts that time once.

Pure Python over events with ``name``, ``thread``, ``time_range`` (.start/.end, microseconds),
``input_shapes``, ``input_dtypes`` and ``cpu_parent`` (torch's FunctionEvent), so tests can feed
hand-made events.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from amsp_ext.compare.trace import COMM_WORKER_PREFIXES, subtract, total, union
from amsp_ext.compare.wire import wire_of
from amsp_ext.topology.groups import ALL_REDUCE_KINDS, group_kind

__all__ = ["KINDS", "PHASES", "Collective", "median_step", "overlap_windows", "step_breakdown", "timeline"]

KINDS = ("AG", "RS", "AR", "BC", "other")
PHASES = ("forward", "backward", "optimizer", "post_step_broadcast", "outside")
STEP_LABEL = "phase::step"

# issue op (the dispatcher op's name without namespace) -> (op class, worker op names)
_ISSUE_OPS = {
    "allreduce_": ("all_reduce", ("all_reduce",)),
    "all_reduce": ("all_reduce", ("all_reduce",)),
    "allreduce_coalesced_": ("all_reduce", ("all_reduce", "allreduce_coalesced")),
    "_allgather_base_": ("all_gather", ("all_gather", "_allgather_base")),
    "allgather_": ("all_gather", ("all_gather",)),
    "allgather_into_tensor_coalesced_": ("all_gather", ("all_gather",)),
    "all_gather_into_tensor": ("all_gather", ("all_gather",)),
    "_reduce_scatter_base_": ("reduce_scatter", ("all_reduce", "reduce_scatter")),
    "reduce_scatter_": ("reduce_scatter", ("all_reduce", "reduce_scatter")),
    "reduce_scatter_tensor": ("reduce_scatter", ("all_reduce", "reduce_scatter")),
    "broadcast_": ("broadcast", ("broadcast",)),
    "reduce_": ("reduce", ("reduce",)),  # DeepSpeed ZeRO-1/2: each partition to its owner
    "broadcast": ("broadcast", ("broadcast",)),
}
_API_NAMESPACES = ("c10d::", "_c10d_functional::", "c10d_functional::")
# a reduce to one owner is one piece of a reduce-scatter (DeepSpeed reduces each rank's
# partition with ``dist.reduce``)
_OP_KIND = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC",
            "reduce": "RS"}
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
                "int": 4, "unsigned char": 1, "signed char": 1, "bool": 1}


@dataclass
class Collective:
    kind: str
    phase: str
    op: str
    label: str  # the enclosing amsp::/FSDP::/DDP label of its issue ("" if none)
    nbytes: int
    issued: float  # seconds
    ended: float
    worker_start: float
    # the bytes of its full-size tensor: a reduction's input (the whole gradient a reduce-scatter
    # takes, not the shard it returns), an all-gather's output; and of one element
    # (compare/wire.py [Note: bytes on the wire])
    full_bytes: int = 0
    elem_bytes: int = 4
    dtype: str = "?"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "phase": self.phase, "op": self.op, "label": self.label,
                "bytes": self.nbytes, "issued": self.issued, "ended": self.ended,
                "worker_start": self.worker_start, "full_bytes": self.full_bytes,
                "elem_bytes": self.elem_bytes, "dtype": self.dtype}


def _span(e) -> tuple[float, float]:
    return (e.time_range.start * 1e-6, e.time_range.end * 1e-6)


def _ancestors(e) -> Iterable:
    p = getattr(e, "cpu_parent", None)
    while p is not None:
        yield p
        p = getattr(p, "cpu_parent", None)


def _issue_info(e) -> tuple[str, str]:
    """(phase, label) of an issue event, from its enclosing labels."""
    phase, label, bcast_params = "outside", "", False
    for a in _ancestors(e):
        n = a.name
        if n.startswith("phase::") and phase == "outside" and n != STEP_LABEL:
            phase = n.split("::", 1)[1]
        elif not label and (n.startswith(("amsp::", "FSDP::", "DistributedDataParallel"))):
            label = n
        if n.startswith("amsp::broadcast_params"):
            bcast_params = True
    if bcast_params:
        phase = "post_step_broadcast"
    return phase, label


def _kind(op: str, api: str, label: str) -> str:
    if api.startswith(("_c10d_functional::", "c10d_functional::")):
        return "other"
    if label.startswith("amsp::"):
        group = group_kind(label.rsplit("::", 1)[-1])
        if group in ALL_REDUCE_KINDS:  # a two-level all-reduce's RS and AG too
            return "AR"
        if label.startswith("amsp::reduce_scatter::"):  # on gloo issued as an all-reduce
            return "RS"  # (runtime/collectives.py [Note: a reduce-scatter that can be polled (gloo)])
        if op == "all_reduce":
            return "other"
        if op == "broadcast" and group != "optim_bcast":
            return "other"
    if label.startswith("DistributedDataParallel.forward"):
        return "other"  # DDP's buffer broadcast
    return _OP_KIND.get(op, "other")


def _input_shapes(e) -> list:
    """An issue's input shapes, a tensor list's one tensor read from ``structured_input_shapes``
    ([Note: match by numel across process groups]); a list of several tensors stays empty."""
    shapes = list(getattr(e, "input_shapes", None) or [])
    structured = list(getattr(e, "structured_input_shapes", None) or [])
    for i, s in enumerate(structured[:len(shapes)]):
        if not shapes[i] and isinstance(s, list) and len(s) == 1 and isinstance(s[0], list):
            shapes[i] = s[0]
    return shapes


def _numel(shape) -> int | None:
    if not shape:
        return None
    n = 1
    for d in shape:
        n *= int(d)
    return n


_DTYPE_NAMES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}


def _elem_bytes(dtypes) -> int:
    for d in dtypes or ():
        if d in _DTYPE_BYTES:
            return _DTYPE_BYTES[d]
    return 4


def _dtype_name(dtypes) -> str:
    """The first recognised dtype of a profiler event's inputs ("fp32", "bf16", ...; "?")."""
    for d in dtypes or ():
        if d in _DTYPE_BYTES:
            return _DTYPE_NAMES.get(d, d)
    return "?"


def _outermost(issues: list[dict]) -> list[dict]:
    """Issues (sorted by start) less those inside another issue on the same thread: a
    functional collective (``_c10d_functional::all_reduce``, DTensor's clip norm) issues its
    ``c10d::allreduce_`` inside itself, and the pair is one collective with one run. Kept
    twice, the inner one - of unknown numel - would stay unmatched and be paired with the next
    step's first all-reduce, shifting every later match by one (a step would lose one of its
    all-reduces to the step before)."""
    out: list[dict] = []
    open_by_thread: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for i in issues:
        e = i["event"]
        spans = open_by_thread[e.thread]
        if any(a <= e.time_range.start and e.time_range.end <= b for a, b in spans):
            continue
        spans.append((e.time_range.start, e.time_range.end))
        out.append(i)
    return out


def collectives(events: list) -> tuple[list[Collective], set]:
    """Every collective run seen in ``events`` matched to its issue; and the worker threads."""
    workers = [e for e in events if e.name.startswith(COMM_WORKER_PREFIXES)]
    worker_threads = {e.thread for e in workers}
    issues = []
    for e in events:
        if e.thread in worker_threads or not e.name.startswith(_API_NAMESPACES):
            continue
        op_name = e.name.split("::", 1)[1]
        if op_name not in _ISSUE_OPS:
            continue
        op, accepts = _ISSUE_OPS[op_name]
        phase, label = _issue_info(e)
        numels = [_numel(s) for s in _input_shapes(e)]
        # what the worker's event will show: gloo runs a reduce-scatter as an all-reduce of its
        # input (the second argument); an all-gather shows one of its two tensors; a list of
        # several tensors (allreduce_coalesced_) is unknown, matched only where no known one fits
        known = ({numels[1]} if op == "reduce_scatter" and len(numels) > 1 and numels[1]
                 else {n for n in numels[:2] if n} if op == "all_gather" else
                 {n for n in numels[:1] if n} if op_name != "allreduce_coalesced_"
                 else set())
        issues.append({"event": e, "op": op, "accepts": accepts, "phase": phase, "label": label,
                       "numels": known, "first_numel": numels[0] if numels else None,
                       "full_numel": (numels[1] if op == "reduce_scatter" and len(numels) > 1
                                      else max([n for n in numels[:2] if n], default=None)
                                      if op == "all_gather" else None),
                       "used": False})
    issues.sort(key=lambda i: i["event"].time_range.start)
    issues = _outermost(issues)
    out: list[Collective] = []
    for w in sorted(workers, key=lambda e: e.time_range.start):
        wop = w.name.split(":", 1)[1]
        shapes = list(getattr(w, "input_shapes", None) or [])
        wnumel = _numel(shapes[0]) if shapes else None
        elem = _elem_bytes(getattr(w, "input_dtypes", None))
        dtype = _dtype_name(getattr(w, "input_dtypes", None))
        exact = fallback = None  # the earliest issue of this numel; else of an unknown one
        for i in issues:
            if i["event"].time_range.start > w.time_range.start:
                break
            if i["used"] or wop not in i["accepts"]:
                continue
            if i["numels"]:
                if wnumel in i["numels"]:
                    exact = i
                    break
            elif fallback is None:
                fallback = i
        match = exact or fallback
        ws, we = _span(w)
        if match is None:  # issued before the profile started
            out.append(Collective(kind=_OP_KIND.get(wop, "other"), phase="outside", op=wop, label="",
                                  nbytes=(wnumel or 0) * elem, issued=ws, ended=we, worker_start=ws,
                                  full_bytes=(wnumel or 0) * elem, elem_bytes=elem, dtype=dtype))
            continue
        match["used"] = True
        api = match["event"].name
        numel = match["first_numel"] or wnumel or 0
        out.append(Collective(kind=_kind(match["op"], api, match["label"]), phase=match["phase"],
                              op=match["op"], label=match["label"], nbytes=numel * elem,
                              issued=_span(match["event"])[0], ended=we, worker_start=ws,
                              full_bytes=(match["full_numel"] or numel) * elem, elem_bytes=elem,
                              dtype=dtype))
    return out, worker_threads


def _intersect(a: list, b: list) -> list:
    return subtract(a, subtract(a, b))


def _blocking_sites(events: list, worker_threads: set) -> list[tuple[float, float, str]]:
    """Non-aten spans of the training threads, innermost last when sorted by length (for the
    ``waits`` attribution)."""
    out = []
    for e in events:
        if e.thread in worker_threads or e.name.startswith("aten::") or e.name.startswith("phase::"):
            continue
        if e.name.startswith(_API_NAMESPACES) or e.name.startswith("PyTorch Profiler"):
            continue
        a, b = _span(e)
        out.append((a, b, e.name))
    return out


def _site_of(t: float, sites: list) -> str:
    best, best_len = "(between ops)", float("inf")
    for a, b, name in sites:
        if a <= t < b and b - a < best_len:
            best, best_len = name, b - a
    return best


def step_breakdown(events: list, index: int = -1) -> dict[str, Any] | None:
    """The breakdown of the ``index``-th ``phase::step`` in ``events`` (default: the last; see
    [Note: one step's breakdown]); None without a labelled step."""
    steps = sorted((e for e in events if e.name == STEP_LABEL), key=lambda e: e.time_range.start)
    if not steps:
        return None
    i = index % len(steps)
    t0, t1 = _span(steps[i])
    colls, worker_threads = collectives(events)
    prev = _span(steps[i - 1]) if i > 0 else None
    chosen = []
    for c in colls:
        if c.phase == "post_step_broadcast":
            if prev is not None and prev[0] <= c.issued < prev[1]:
                chosen.append(c)
        elif t0 <= c.issued < t1:
            chosen.append(c)
    lo = min([t0] + [c.issued for c in chosen])
    hi = max([t1] + [c.ended for c in chosen])
    main = [e for e in events if e.thread not in worker_threads]
    api = union(_span(e) for e in main if e.name.startswith(_API_NAMESPACES))
    aten = union(_span(e) for e in main if e.name.startswith("aten::"))
    compute = subtract(aten, api)
    compute_in = _intersect(compute, [(lo, hi)])
    sites = [s for s in _blocking_sites(main, worker_threads) if s[1] > lo and s[0] < hi]

    def summarize(cs: list[Collective]) -> dict[str, Any]:
        spans = union((c.issued, c.ended) for c in cs)
        exposed = subtract(spans, compute_in)
        waits: dict[str, float] = defaultdict(float)
        for a, b in exposed:
            waits[_site_of((a + b) / 2, sites)] += b - a
        top = sorted(waits.items(), key=lambda kv: -kv[1])[:3]
        return {"count": len(cs), "bytes": sum(c.nbytes for c in cs), "busy_s": total(spans),
                "sum_s": sum(c.ended - c.issued for c in cs), "exposed_s": total(exposed),
                "overlapped_s": total(_intersect(spans, compute_in)),
                "waits": [{"site": k, "s": v} for k, v in top]}

    rows = []
    for phase in PHASES:
        for kind in KINDS:
            cs = [c for c in chosen if c.phase == phase and c.kind == kind]
            if cs:
                rows.append({"phase": phase, "kind": kind, **summarize(cs)})
    kinds = {k: summarize([c for c in chosen if c.kind == k]) for k in KINDS
             if any(c.kind == k for c in chosen)}
    all_spans = union((c.issued, c.ended) for c in chosen)
    totals = {"step_s": t1 - t0, "compute_s": total(_intersect(compute, [(t0, t1)])),
              "comm_s": total(all_spans), "exposed_s": total(subtract(all_spans, compute_in)),
              "count": len(chosen), "bytes": sum(c.nbytes for c in chosen)}
    step_events = [e for e in events if e.time_range.end > t0 * 1e6 and e.time_range.start < t1 * 1e6]
    return {"rows": rows, "kinds": kinds, "totals": totals, "wire": wire_of(chosen),
            "overlap_windows": overlap_windows(step_events),
            "timeline": timeline(chosen, compute_in, origin=t0)}


# [Note: the median profiled step]
# On a shared CPU one step's exposed time says more about the load during it than about the
# engine (one round's step can expose a twentieth of the median: comparisons/results/design_history.md,
# "Comparison noise"). So the worker can profile several steps
# (``RunSpec.trace_steps``); every step after the first is read (the first only supplies its
# post-step broadcasts) and the one whose exposed time is the median (the lower one for an even
# count) is kept whole: its rows add up to its totals, which per-field medians would not.
# ``exposed_s_per_step`` keeps every step's figure.
def median_step(events: list) -> tuple[dict[str, Any], Any] | None:
    """``(breakdown, step event)`` of [Note: the median profiled step]; None with fewer than
    two labelled steps."""
    steps = sorted((e for e in events if e.name == STEP_LABEL), key=lambda e: e.time_range.start)
    if len(steps) < 2:
        return None
    read = [step_breakdown(events, index=i) for i in range(1, len(steps))]
    exposed = [b["totals"]["exposed_s"] for b in read]
    median = sorted(range(len(read)), key=exposed.__getitem__)[(len(read) - 1) // 2]
    return {**read[median], "exposed_s_per_step": exposed}, steps[1 + median]


def timeline(chosen: list[Collective], compute: list, *, origin: float) -> dict[str, Any]:
    """Intervals (seconds from the step's start) for the timeline plot: compute, and per kind
    each collective's queued part [issued, run start) and run [run start, ended]."""
    def rel(a: float, b: float) -> list[float]:
        return [round(a - origin, 6), round(b - origin, 6)]

    per_kind: dict[str, list] = defaultdict(list)
    for c in chosen:
        per_kind[c.kind].append({"issued": rel(c.issued, c.issued)[0], "start": rel(c.worker_start, c.worker_start)[0],
                                 "end": rel(c.ended, c.ended)[0], "phase": c.phase, "bytes": c.nbytes})
    return {"compute": [rel(a, b) for a, b in compute], "collectives": dict(per_kind)}


# [Note: issue-to-wait windows]
# Whether a collective overlapped anything is, without any timing, a fact of program order: did
# the training thread run compute (a matmul) between issuing the collective and waiting for
# it? AMSP's collectives carry ``amsp::<op>::<group>`` labels where issued and
# ``amsp::wait::<op>::<group>`` where waited (collectives.py); waits of one (op, group) follow
# issue order (buckets complete oldest first, broadcasts and gathers in forward order), so the
# k-th wait of a label is the k-th issue's. A Table V switch turned off waits for each
# collective where it is issued: none of that kind's windows holds a matmul; on, the
# prefetched gathers, the buckets launched mid-backward and the broadcasts waited in the next
# forward do. A collective never waited (its handle dropped) has no window.
_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def overlap_windows(events: list) -> dict[str, dict[str, int]]:
    """Per kind: ``waited`` collectives (issued and waited inside ``events``) and ``with_compute``
    (a matmul started on the issuing thread between the issue and the wait)."""
    marks = []  # (time, what, key)
    for e in events:
        n = e.name
        if n.startswith("amsp::wait::"):
            _, _, op, group = n.split("::", 3)
            marks.append((e.time_range.start, 2, (op, group), e.thread))
        elif n.startswith(("amsp::all_reduce::", "amsp::all_gather::", "amsp::reduce_scatter::",
                           "amsp::broadcast::")):
            _, op, group = n.split("::", 2)
            marks.append((e.time_range.end, 0, (op, group), e.thread))
        elif n in _MATMULS:
            marks.append((e.time_range.start, 1, None, e.thread))
    marks.sort(key=lambda m: (m[0], m[1]))
    open_issues: dict[tuple, list[list]] = defaultdict(list)  # key -> [[matmul seen?]] FIFO
    out: dict[str, dict[str, int]] = {}
    for _, what, key, thread in marks:
        if what == 1:
            for q in open_issues.values():
                for entry in q:
                    if entry[1] == thread:
                        entry[0] = True
        elif what == 0:
            open_issues[key].append([False, thread])
        elif open_issues[key]:
            seen, _ = open_issues[key].pop(0)
            op, group = key
            label = f"amsp::{op}::{group}"
            kind = _kind(op, "c10d::", label)
            rec = out.setdefault(kind, {"waited": 0, "with_compute": 0})
            rec["waited"] += 1
            rec["with_compute"] += int(seen)
    return out
