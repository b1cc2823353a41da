"""torchrun worker (2 ranks) for tests/test_no_pickle.py: a checkpoint saved and loaded (into
another plan) while every pickle entry point raises, and a negative control showing that the
trap catches torch's own object collectives. Prints ``RESULT {json}`` on rank 0.

Usage: python -m tests.no_pickle_worker DIR
"""

from __future__ import annotations

import contextlib
import datetime
import json
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.checkpoint_worker import make, release, train, weights
from tests.dist_utils import end_worker

A, B = "p=2x1,g=2x1,os=2x1", "p=1x1,g=1x1,os=2x1"  # sp=2 saved, sp=1 loaded: a resharding load


class Trapped(RuntimeError):
    pass


CALLS: list[str] = []


@contextlib.contextmanager
def no_pickle():
    """Every way torch or our code could (un)pickle raises ``Trapped`` (and is recorded)."""
    def trap(name):
        def f(*a, **k):
            CALLS.append(name)
            raise Trapped(f"{name} called")
        return f

    def trap_class(name):
        class Trap:  # Pickler(...) / Unpickler(...) and subclasses' construction
            def __init__(self, *a, **k):
                CALLS.append(name)
                raise Trapped(f"{name} used")
        return Trap

    saved = {(pickle, n): getattr(pickle, n) for n in ("load", "loads", "Unpickler", "dumps", "Pickler")}
    saved.update({(c10d, n): getattr(c10d, n) for n in ("_unpickler", "_pickler")})
    saved[(torch, "load")] = torch.load
    saved[(torch.serialization, "load")] = torch.serialization.load
    for (mod, n) in saved:
        setattr(mod, n, trap_class(f"{mod.__name__}.{n}") if n in ("Unpickler", "_unpickler", "Pickler", "_pickler")
                else trap(f"{mod.__name__}.{n}"))
    try:
        yield
    finally:
        for (mod, n), v in saved.items():
            setattr(mod, n, v)


def main(root: Path) -> None:
    t0 = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    R = dist.get_world_size()
    model, opt, sched = make(A, R)
    train(model, opt, sched, (0,))
    with no_pickle():
        from amsp_ext.runtime.state.checkpoint import load_checkpoint, save_checkpoint

        save_checkpoint(model, opt, root / "ck", lr_scheduler=sched, extra={"step": 1})
    w_saved = weights(model)
    ref_next = train(model, opt, sched, (1,))
    release(model)

    other, other_opt, other_sched = make(B, R, seed=1)  # another seed: a no-op load would differ
    with no_pickle():
        extra = load_checkpoint(other, other_opt, root / "ck", lr_scheduler=other_sched)
        calls_in_amsp = list(CALLS)
    w_loaded = weights(other)
    diff = max(float((w_saved[k] - w_loaded[k]).abs().max()) for k in w_saved)
    next_loss = train(other, other_opt, other_sched, (1,))

    # negative control: DCP handed a process group (its default) exchanges pickles; the trap fires
    import torch.distributed.checkpoint as dcp

    from amsp_ext.runtime.state import dcp_io

    md = dcp_io.metadata(root / "ck")
    key = sorted(md)[0]
    control = None
    with no_pickle():
        try:
            dcp.load({key: torch.empty(tuple(md[key].size), dtype=md[key].properties.dtype)},
                     storage_reader=dcp.HuggingFaceStorageReader(str(root / "ck")))
        except BaseException as e:  # noqa: BLE001 - DCP wraps the trapped call
            control = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    release(other)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "pickle_calls_during_save_and_load": calls_in_amsp, "weights_max_abs_diff": diff,
            "extra": extra, "ref_next_loss": ref_next, "loaded_next_loss": next_loss,
            "control_error": control, "control_calls": CALLS[len(calls_in_amsp):]}), flush=True)
    end_worker(t0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
