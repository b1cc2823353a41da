"""The tensor-parallel degree chosen jointly with the six factors, under a global-batch cap.

[Note: choosing T]
For each degree T asked for (``--tensor-parallel auto``: every degree of TP_DEGREES the node
and the model allow, tensor_parallel.tp_degrees) the job becomes an AMSP problem over the
data-parallel world (tensor_parallel.py [Note: a TP job is an AMSP job of TP shards]) and the
six factors are searched as ever. A degree is out when
* its global batch, (R/T) x N x micro-batch x M x seq, exceeds ``max_global_batch_tokens``
  (M is what the batch flags give: ``--micro-batches`` fixes it per rank, so the batch shrinks
  with T; ``--global-batch-tokens`` fixes the batch, so M grows with T, and a batch smaller than
  one sequence per data-parallel rank cannot be split at small T); the planner does not search M;
* no plan of its world fits in memory, or its problem cannot be built (the batch does not
  divide, the profile lacks a mesh): the one-line reason is kept.
Among the rest the degree whose best plan has the lowest objective *per token of the global
batch* wins: with ``--micro-batches`` the degrees' steps carry different batches, and per
token is the same order as per step when the batch is fixed. Degrees within the problem's tie
tolerance of the best are equally fast and the smallest wins: fewer all-reduces on the critical
path, whose price (an all-reduce of the profile on T x 1) is the least measured part of the model.
Every degree's outcome is reported, so nothing is dropped silently.

Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from amsp_ext.planner.search import Problem, SearchResult

__all__ = ["TPChoice", "TPOption", "search_tensor_parallel"]

Extra = TypeVar("Extra")


@dataclass(frozen=True, kw_only=True)
class TPOption:
    """One degree's outcome: its best plan and objective, or why it is out."""

    degree: int
    global_batch_tokens: int | None = None
    plan: str | None = None
    objective_s: float | None = None
    reason: str = ""  # why it is out ("" when it has a plan)

    @property
    def per_token_s(self) -> float | None:
        if self.objective_s is None or not self.global_batch_tokens:
            return None
        return self.objective_s / self.global_batch_tokens

    def as_dict(self) -> dict[str, Any]:
        return {"tensor_parallel": self.degree, "global_batch_tokens": self.global_batch_tokens,
                "plan": self.plan, "objective_s": self.objective_s,
                "objective_s_per_token": self.per_token_s, "reason": self.reason}


@dataclass(frozen=True, kw_only=True)
class TPChoice:
    degree: int
    auto: bool
    max_global_batch_tokens: int | None
    options: tuple[TPOption, ...]

    def describe(self) -> str:
        how = "auto" if self.auto else "asked for"
        cap = ("" if self.max_global_batch_tokens is None
               else f", global batch <= {self.max_global_batch_tokens} tokens")
        parts = []
        for o in self.options:
            if o.reason:
                parts.append(f"T={o.degree}: {o.reason}")
            else:
                parts.append(f"T={o.degree}: {o.plan}, {o.objective_s:.3f} s per {o.global_batch_tokens}"
                             f"-token step")
        return f"tensor parallel {self.degree} ({how}{cap}; " + "; ".join(parts) + ")"

    def as_dict(self) -> dict[str, Any]:
        return {"tensor_parallel": self.degree, "auto": self.auto,
                "max_global_batch_tokens": self.max_global_batch_tokens,
                "options": [o.as_dict() for o in self.options]}


def search_tensor_parallel(
    degrees: Sequence[int], problem_for: Callable[[int], Problem],
    search_for: Callable[[int], tuple[SearchResult, Extra]], *,
    max_global_batch_tokens: int | None = None, auto: bool = True,
) -> tuple[SearchResult, Extra, TPChoice]:
    """[Note: choosing T]. ``problem_for(T)`` builds the job at degree T (its batch is checked
    against the cap before any search), ``search_for(T)`` searches it and returns its result
    and what the caller attaches (e.g. the all-reduce choice). Returns the chosen degree's.
    Raises a one-line ValueError when no degree is left (with one degree and no cap, its own
    error unchanged)."""
    options: list[TPOption] = []
    found: dict[int, tuple[SearchResult, Extra]] = {}
    errors: dict[int, ValueError] = {}
    for t in degrees:
        try:
            tokens = problem_for(t).global_batch_tokens
        except ValueError as e:
            errors[t] = e
            options.append(TPOption(degree=t, reason=str(e)))
            continue
        if max_global_batch_tokens is not None and tokens > max_global_batch_tokens:
            options.append(TPOption(degree=t, global_batch_tokens=tokens,
                                    reason=f"global batch of {tokens} tokens exceeds "
                                           f"--max-global-batch-tokens {max_global_batch_tokens}"))
            continue
        try:
            found[t] = search_for(t)
        except ValueError as e:
            errors[t] = e
            options.append(TPOption(degree=t, global_batch_tokens=tokens, reason=str(e)))
            continue
        res = found[t][0]
        options.append(TPOption(degree=t, global_batch_tokens=tokens, plan=str(res.best.plan),
                                objective_s=res.objective(res.best)))
    live = [o for o in options if not o.reason]
    if not live:
        if len(degrees) == 1 and degrees[0] in errors:
            raise errors[degrees[0]]
        hint = "" if auto else " (--tensor-parallel auto tries every degree)"
        raise ValueError(f"no --tensor-parallel degree fits{hint}: "
                         + "; ".join(f"T={o.degree}: {o.reason}" for o in options))
    best = min(o.per_token_s for o in live)
    tol = found[live[0].degree][0].problem.tie_tolerance
    chosen = min(o.degree for o in live if o.per_token_s <= best * (1 + tol))
    result, extra = found[chosen]
    return result, extra, TPChoice(degree=chosen, auto=auto, max_global_batch_tokens=max_global_batch_tokens,
                                   options=tuple(options))
