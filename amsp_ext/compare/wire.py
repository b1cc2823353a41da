"""What a row sent on the wire in one step, measured from its own trace: bytes per collective op,
the gradient bytes and the dtypes of gradients and parameters; and when two rows' ratio is not a
like-for-like comparison of what they sent.

[Note: bytes on the wire]
Every figure here comes from the collectives of the profiled step (compare/breakdown.py: each
gloo run matched to its issue, with the dtype of its tensor), not from a system's settings: a
setting that a system ignores shows up as bytes it did not save. Per collective the bytes of its
*full-size* tensor count: a reduction's input (the whole gradient a reduce-scatter takes, not the
shard it returns), an all-gather's output. So

    gradient bytes per step = sum over the step's gradient reductions (all-reduce, reduce-scatter,
                              reduce; kinds AR/RS) of their input bytes,

i.e. element size x the parameters each reduction reduces, once per reduction: DDP's one bucketed
all-reduce a step is 4 B (fp32) or 2 B (bf16 hook) x all parameters; HSDP's reduce-scatter on
every micro-batch counts M times and its replica all-reduce of the shard once; a two-level
all-reduce is one reduction of the whole gradient and counts once, by its in-node
reduce-scatter's input: its across-nodes all-reduce reduces the shard of that same gradient
(topology/groups.py ``is_cross_node_level``) and its all-gather hands results back. So DDP's
plan run flat or two-level reduces the same bytes, as it reduces the same gradient (the bytes
each level moves stay in ``bytes_per_step``). Scalar reductions (clip norms, overflow flags: one
element) are left out of the gradient figure but kept in ``bytes_per_step``. Parameter
collectives are the all-gathers and broadcasts (kinds AG/BC): their dtype is the parameters'
wire dtype.

[Note: which ratios are refused]
A ratio of two rows is the engine's or the plan's only if both moved the same gradient bytes in
the same dtype. The report refuses it (one line saying which rows and why, no number) when
- either row did not reduce in the asked ``--reduce-dtype`` (a system that cannot, or ignored
  the setting: its row in the wire table says so), or
- their measured gradient dtypes differ (any plan shapes: 2-byte against 4-byte gradients), or
- they run the same plan shape (``SHAPE_OF``: DDP and AMSP's ``ddp``, HSDP / DeepSpeed-MiCS and
  AMSP's ``mics:K``, ...) and their gradient bytes per step differ by more than ``BYTES_TOLERANCE``
  (different accumulation, a missing reduction, or dtypes in part), or
- they run the same plan shape and one of them counted different gradient bytes on its ranks or
  rounds (by more than ``BYTES_TOLERANCE``): every rank reduces the same gradient, so a row whose
  readings disagree was read wrong somewhere, and its one figure (rank 0's, first round) cannot
  vouch for the bytes. The harness reads each rank's profiled step on its own, so this is what
  catches a misread trace (breakdown.py [Note: match by numel across process groups]).
Rows without a measured wire (``--no-trace``, reports written before it existed) are compared
with a note saying the bytes were not checked.
"""

from __future__ import annotations

from typing import Any, Iterable

from amsp_ext.compare.systems import DDP_BUCKETS_MB, ddp_bucket_system
from amsp_ext.topology.groups import is_cross_node_level

__all__ = ["BYTES_TOLERANCE", "GRAD_KINDS", "PARAM_KINDS", "grad_counts", "not_as_asked", "plan_shape",
           "wire_mismatch", "wire_of"]

GRAD_KINDS = ("AR", "RS")
PARAM_KINDS = ("AG", "BC")
_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")
BYTES_TOLERANCE = 0.05


def _dtype_of(dtypes: set[str]) -> str | None:
    return None if not dtypes else "+".join(sorted(dtypes))


def wire_of(collectives: Iterable[Any]) -> dict[str, Any]:
    """The wire record of one step's collectives (``breakdown.Collective``: ``op``, ``kind``,
    ``full_bytes``, ``elem_bytes``, ``dtype``); see [Note: bytes on the wire]."""
    per_op: dict[str, int] = {}
    grad_bytes = param_bytes = 0
    grad_dtypes: set[str] = set()
    param_dtypes: set[str] = set()
    for c in collectives:
        per_op[c.op] = per_op.get(c.op, 0) + c.full_bytes
        if c.kind in GRAD_KINDS and c.op in _REDUCTIONS and c.full_bytes > c.elem_bytes:
            grad_dtypes.add(c.dtype)
            if not is_cross_node_level(getattr(c, "label", "")):
                grad_bytes += c.full_bytes
        elif c.kind in PARAM_KINDS:
            param_bytes += c.full_bytes
            param_dtypes.add(c.dtype)
    return {"grad_dtype": _dtype_of(grad_dtypes), "param_dtype": _dtype_of(param_dtypes),
            "grad_bytes_per_step": grad_bytes, "param_bytes_per_step": param_bytes,
            "bytes_per_step": dict(sorted(per_op.items()))}


# the plan shape of each non-AMSP system, as AMSP names it (planner/plan.py); AMSP rows: their
# plan. Two rows of one shape should move the same gradient bytes.
SHAPE_OF = {"ddp": "ddp", "ddp-bf16": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
            "fsdp2": "zero3", "mics": "mics", "hsdp": "mics", "zeropp": "zero3", "zeropp-q": "zero3",
            # DDP's bucket sweep: the bucket size changes when gradients go, not their bytes
            **{ddp_bucket_system(mb): "ddp" for mb in DDP_BUCKETS_MB}}


def plan_shape(row: dict[str, Any]) -> str | None:
    """The row's plan shape (``SHAPE_OF``; an AMSP row's plan as given, ``mics:K`` as ``mics``;
    a plan given as ``auto`` or as factors: the named shape the plan that ran has, if any; None
    for other factors, which are compared by dtype only)."""
    if not str(row.get("system", "")).startswith("amsp"):
        return SHAPE_OF.get(row.get("system"))
    plan = str((row.get("spec") or {}).get("amsp_plan", "")).strip().lower()
    if row.get("system") == "amsp-mics" or plan.startswith("mics"):
        return "mics"
    if plan in SHAPE_OF.values():
        return plan
    return _named_shape((row.get("settings") or {}).get("plan"), row.get("gpus_per_node"), row.get("num_nodes"))


def _named_shape(ran: Any, gpus_per_node: Any, num_nodes: Any) -> str | None:
    """The named shape (ddp, zero1-3, mics) whose factors on this world equal the plan ``ran``."""
    from amsp_ext.planner.plan import resolve_plan

    if not (isinstance(ran, str) and isinstance(gpus_per_node, int) and isinstance(num_nodes, int)):
        return None
    for name in ("ddp", "zero1", "zero2", "zero3", f"mics:{gpus_per_node}"):
        try:
            if str(resolve_plan(name, gpus_per_node=gpus_per_node, num_nodes=num_nodes)) == ran:
                return name.split(":", 1)[0]
        except ValueError:
            continue
    return None


def not_as_asked(row: dict[str, Any]) -> str | None:
    """Why ``row`` did not reduce its gradients in the asked ``--reduce-dtype`` (a system that
    cannot, or ignored the setting), or None: such a row is left out of every ratio."""
    w = row.get("wire") or {}
    asked, got = w.get("reduce_dtype_asked"), w.get("grad_dtype")
    if asked and got and got != asked:
        return f"{row['label']} reduced gradients in {got}, not the asked {asked}"
    return None


def grad_counts(row: dict[str, Any]) -> list[int]:
    """Every gradient-bytes reading of ``row``: each rank's, of the row and of each of its rounds."""
    wires = [row.get("wire")] + [r.get("wire") for r in row.get("rounds") or []]
    return [n for w in wires if w for n in (w.get("grad_bytes_per_step_ranks") or [w["grad_bytes_per_step"]])
            if n is not None]


def wire_mismatch(num: dict[str, Any], den: dict[str, Any]) -> str | None:
    """Why the ratio ``num / den`` is refused ([Note: which ratios are refused]), or None."""
    for row in (num, den):
        why = not_as_asked(row)
        if why:
            return why
    a, b = num.get("wire"), den.get("wire")
    if not a or not b:
        return None
    if a["grad_dtype"] and b["grad_dtype"] and a["grad_dtype"] != b["grad_dtype"]:
        return (f"gradients on the wire differ: {num['label']} {a['grad_dtype']}, "
                f"{den['label']} {b['grad_dtype']}")
    shape = plan_shape(num)
    if shape is None or shape != plan_shape(den):
        return None
    for row in (num, den):
        counts = grad_counts(row)
        if counts and max(counts) - min(counts) > BYTES_TOLERANCE * max(counts):
            return (f"same plan shape ({shape}) but {row['label']}'s ranks and rounds counted "
                    f"{min(counts):,}-{max(counts):,} gradient bytes per step: not read alike")
    x, y = a["grad_bytes_per_step"], b["grad_bytes_per_step"]
    if max(x, y) and abs(x - y) > BYTES_TOLERANCE * max(x, y):
        return (f"same plan shape ({shape}) but gradient bytes per step differ by more than "
                f"{BYTES_TOLERANCE:.0%}: {num['label']} {x:,} B, {den['label']} {y:,} B")
    return None
