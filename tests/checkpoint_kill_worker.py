"""Kill a save at chosen points and check that the previous checkpoint survives.

One process, forked per save (the parent imports torch, transformers' Llama and the engine's
modules once: imports only, no tensor op and no thread before a fork, as in tests/fork_launch.py;
each child starts its own 1-rank gloo group). Generation g's child loads the checkpoint
(generation g - 1, or whatever survived the last kill), checks that its probe loss is the one
recorded when it was saved, trains one step and saves over it. A kill point is the k-th file-system event of a save (an
``open``/``mkdir``/``rename``/``rmtree``/``remove``/``listdir`` under the root, or the
publishing rename, ``amsp.checkpoint.publish``), caught by an audit hook that SIGKILLs the process before
the event happens. Every save starts over a stale staging directory (as after a killed save),
so the events are the same in every run. ``RESULT {json}`` lines report what each child saw.

Usage: python -m tests.checkpoint_kill_worker ROOT NUM_POINTS SEED
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
from pathlib import Path

import torch

from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss

PATH_EVENTS = {"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.listdir",
               "os.scandir"}


def _events_hook(root: str, on_event):
    def hook(event, args):
        if event == "amsp.checkpoint.publish" or (
                event in PATH_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike))
                and os.fsdecode(args[0]).startswith(root)):
            if event == "open" and len(args) > 1 and args[1] in (None, "r", "rb"):
                return  # reads: not a change on disk (hashing reads back every file)
            on_event(event, args)
    return hook


def child(root: Path, gen: int, kill_at: int | None, count_file: Path | None) -> None:
    import torch.distributed as dist
    from torch.distributed import HashStore

    from amsp_ext.runtime.state.checkpoint import load_checkpoint, read_checkpoint_meta, save_checkpoint
    from amsp_ext.runtime.config import ShardConfig
    from amsp_ext.runtime.shard import shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=HashStore())
    model, opt = shard(build_llama("tiny-llama", seed=gen), "p=1x1,g=1x1,os=1x1",
                       lambda p: torch.optim.AdamW(p, lr=1e-3), config=ShardConfig(gpus_per_node=1, timeout=60))
    probe = micro_batch(99, 0, 0, world_size=1, num_micro_batches=1, micro_batch_size=2, seq_len=32)
    ckpt = root / "ckpt"
    seen = None
    if gen > 0:
        load_checkpoint(model, opt, ckpt)
        info = read_checkpoint_meta(ckpt)["info"]
        with torch.no_grad():
            loss = causal_lm_loss(model, probe).item()
        seen = {"gen": info["gen"], "probe_ok": loss == info["probe_loss"]}
    loss = causal_lm_loss(model, micro_batch(gen, 0, 0, world_size=1, num_micro_batches=1,
                                             micro_batch_size=2, seq_len=32))
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        probe_loss = causal_lm_loss(model, probe).item()
    events: list[str] = []

    def on_event(event, args):
        events.append(event)
        if kill_at is not None and len(events) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(_events_hook(str(root), on_event))
    print("RESULT " + json.dumps({"gen": gen, "loaded": seen, "kill_at": kill_at}), flush=True)
    save_checkpoint(model, opt, ckpt, info={"gen": gen, "probe_loss": probe_loss})
    if count_file is not None:
        count_file.write_text(json.dumps(events))
    os._exit(0)  # no teardown: the audit hook stays installed for the life of the process


def run_child(root: Path, gen: int, kill_at: int | None, count_file: Path | None = None) -> int:
    # every save starts over a stale staging directory, as after a killed save (so that the
    # sequence of events is the same in every run, and the clean-up is exercised too)
    (root / ".ckpt.amsp-staging").mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid == 0:
        try:
            child(root, gen, kill_at, count_file)
        except BaseException as e:  # noqa: BLE001
            print(f"child error: {type(e).__name__}: {e}", flush=True)
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _preload() -> None:
    """What every child imports, imported once here (each of the ~ten children paid ~3.5 s of
    CPU for them, mostly transformers' Llama that build_llama imports lazily). The events a kill
    point counts are those under ROOT only, so they do not change."""
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    import amsp_ext.runtime.config  # noqa: F401
    import amsp_ext.runtime.shard  # noqa: F401
    import amsp_ext.runtime.state.checkpoint  # noqa: F401


def main() -> None:
    root, num_points, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    _preload()
    root.mkdir(parents=True, exist_ok=True)
    assert run_child(root, 0, None) == 0
    # the events of one save over an existing checkpoint (on a copy)
    probe_root = root / "probe"
    shutil.copytree(root / "ckpt", probe_root / "ckpt")
    assert run_child(probe_root, 1, None, count_file=root / "events.json") == 0
    events = json.loads((root / "events.json").read_text())
    shutil.rmtree(probe_root)
    publish = events.index("amsp.checkpoint.publish")
    rng = random.Random(seed)
    points = {0, publish, publish + 1} | set(rng.sample(range(len(events)), num_points))
    points = sorted(p for p in points if p < len(events))
    gen = 1
    for p in points:
        code = run_child(root, gen, p)
        print("RESULT " + json.dumps({"point": p, "event": events[p], "exit": code,
                                      "num_events": len(events)}), flush=True)
        gen += 1
    assert run_child(root, gen, None) == 0  # the last survivor loads; a save runs to the end
    print("RESULT " + json.dumps({"final_listing": sorted(os.listdir(root))}), flush=True)


if __name__ == "__main__":
    main()
