"""The engine's process groups are destroyed at interpreter exit (collectives.py [Note: process
groups torn down at exit]): a script that never calls destroy_process_group() exits with no
live group. The probe's atexit handler is registered before ``shard``, so it runs after the
engine's (atexit is last in, first out) and sees what the engine's left."""

import subprocess
import sys

SCRIPT = r"""
import atexit, sys
import torch, torch.distributed as dist
import amsp_ext

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
sub = dist.new_group([0])
atexit.register(lambda: print("live at exit:", dist.is_initialized(), flush=True))
if sys.argv[1] == "shard":
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model, opt = amsp_ext.shard(model, "ddp", lambda ps: torch.optim.SGD(ps, lr=0.1))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
print("done", flush=True)
"""


def _exit_state(mode: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_groups_destroyed_at_exit_after_shard():
    # the same script without the engine keeps its groups to the end: the probe can tell
    assert "live at exit: True" in _exit_state("plain")
    out = _exit_state("shard")
    assert "done" in out and "live at exit: False" in out, out
