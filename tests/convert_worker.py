"""One-process worker for tests/test_checkpoint_convert.py (a 1-rank gloo group on a HashStore).

Trains tiny-llama one step under AMSP, writes an *old-format* checkpoint by the layout that
amsp-checkpoint/2 used (git history: DCP FileSystemWriter with its pickled ``.metadata``; param
groups, non-tensor optimizer states, ``amsp.state`` and ``amsp.rng.<rank>`` as ``torch.save``
bytes items inside DCP; amsp.json with checksums), then checks, against the values it saved:
the loader refuses it naming the convert command; ``amsp checkpoint convert`` without
``--trust`` refuses it; with ``--trust`` it converts, and a fresh model (another seed) loads
the result with every tensor, optimizer state, counter, scheduler, ``extra`` and RNG stream
restored. Prints ``RESULT {json}``.

Usage: python -m tests.convert_worker DIR
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import HashStore

from amsp_ext.runtime.shard import shard
from amsp_ext.runtime.config import ShardConfig
from amsp_ext.common.data import micro_batch
from amsp_ext.common.models import build_llama, causal_lm_loss

PLAN = "p=1x1,g=1x1,os=1x1"
OLD_FORMAT = "amsp-checkpoint/2"


def make(seed):
    model = build_llama("tiny-llama", seed=seed)
    model, opt = shard(model, PLAN, lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95)),
                       config=ShardConfig(gpus_per_node=1, timeout=60))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def step(model, opt, sched, i):
    b = micro_batch(i, 0, 0, world_size=1, num_micro_batches=1, micro_batch_size=2, seq_len=32)
    loss = causal_lm_loss(model, b)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    sched.step()
    return float(loss.detach())


def _pack(obj) -> bytes:  # the old layout: torch.save bytes stored as one DCP bytes item
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_old(model, opt, sched, path: Path, extra) -> None:
    """An amsp-checkpoint/2 folder, by the layout of that format (see the module docstring)."""
    import torch.distributed.checkpoint as dcp

    from amsp_ext.runtime.state.checkpoint import _meta, rng_state
    from amsp_ext.runtime.state.checkpoint_files import META_FILE, _self_checksum, file_digest

    e = model.amsp
    sd = {"model." + k: v.detach() for k, v in model.sharded_state_dict().items()}
    group_of = {id(p): g for g in opt.inner.param_groups for p in g["params"]}
    rows = []
    for idx, m in opt.masters.items():
        t = e.tensors[idx]
        kinds = {}
        for k, v in opt.inner.state.get(m, {}).items():
            key = f"optim.state.{t.name}.{k}"
            if not torch.is_tensor(v):
                sd[key], kinds[k] = _pack(v), "object"
            elif v.dim() == 0:
                sd[key], kinds[k] = v.detach(), "scalar"
            else:
                sd[key], kinds[k] = v.detach(), "param"
        sd["optim.param_groups." + t.name] = _pack({k: v for k, v in group_of[id(m)].items() if k != "params"})
        rows.append({"name": t.name, "index": t.index, "shard_index": t.shard_index,
                     "global_shape": list(t.global_shape), "local_shape": list(t.local_shape),
                     "offset": [0] * len(t.global_shape), "state": kinds, "owners": [0]})
    sd["amsp.state"] = _pack({"num_steps": opt.num_steps, "scaler": None,
                              "lr_scheduler": sched.state_dict(), "extra": extra})
    sd["amsp.rng.0"] = _pack(rng_state(torch.device("cpu")))
    path.mkdir()
    with warnings_off():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    meta = {**_meta(model, e, True, {"run": "old"}), "format": OLD_FORMAT, "tensors": rows}
    meta["files"] = {f.name: file_digest(f) for f in sorted(path.iterdir()) if f.name != META_FILE}
    meta["checksum"] = _self_checksum(meta)
    (path / META_FILE).write_text(json.dumps(meta, indent=1))


@contextlib.contextmanager
def warnings_off():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def amsp(*args):
    p = subprocess.run([sys.executable, "-m", "amsp_ext.cli.main", *args], capture_output=True, text=True,
                       timeout=120)
    return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}


def states(opt, model):
    """Every optimizer state of every owned tensor, by tensor name (tensors as lists)."""
    out = {}
    for idx, m in opt.masters.items():
        name = model.amsp.tensors[idx].name
        out[name] = {k: v.tolist() if torch.is_tensor(v) else v for k, v in opt.inner.state[m].items()}
    return out


def main(root: Path) -> None:
    from amsp_ext.runtime.state.checkpoint import CheckpointError, load_checkpoint

    dist.init_process_group("gloo", rank=0, world_size=1, store=HashStore())
    model, opt, sched = make(0)
    step(model, opt, sched, 0)
    first = model.amsp.tensors[0]
    opt.inner.state[opt.masters[first.index]]["note"] = (3, 2.5)  # a non-tensor state
    old = root / "old"
    extra = {"epoch": 3, "pos": (7, 8)}
    write_old(model, opt, sched, old, extra)
    saved_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_states = states(opt, model)
    saved_lr = sched.get_last_lr()
    rng_next = torch.rand(4).tolist()  # the stream a same-world load restores
    next_loss = step(model, opt, sched, 1)

    fresh, fresh_opt, fresh_sched = make(1)
    try:
        load_checkpoint(fresh, fresh_opt, old, lr_scheduler=fresh_sched)
        refused = None
    except CheckpointError as e:
        refused = str(e)
    no_trust = amsp("checkpoint", "convert", str(old), str(root / "new-untrusted"))
    converted = amsp("checkpoint", "convert", "--trust", str(old), str(root / "new"))
    again = amsp("checkpoint", "convert", "--trust", str(old), str(root / "new"))  # DST exists
    new_meta = json.loads((root / "new" / "amsp.json").read_text())
    got_extra = load_checkpoint(fresh, fresh_opt, root / "new", lr_scheduler=fresh_sched)
    got_rng = torch.rand(4).tolist()
    weights_diff = max(float((saved_weights[k] - v).abs().max()) for k, v in fresh.state_dict().items())
    got_states = states(fresh_opt, fresh)
    result = {
        "refused_old": refused, "no_trust": no_trust, "converted": converted, "dst_exists": again,
        "files": sorted(new_meta["files"]), "format": new_meta["format"],
        "converted_from": new_meta["info"].get("converted_from"),
        "untrusted_dst_created": (root / "new-untrusted").exists(),
        "weights_max_abs_diff": weights_diff, "states_equal": got_states == saved_states,
        "note_state": list(got_states[first.name]["note"]) if "note" in got_states[first.name] else None,
        "num_steps": fresh_opt.num_steps, "saved_num_steps": opt.num_steps - 1,
        "lr": fresh_sched.get_last_lr(), "saved_lr": saved_lr, "extra": got_extra,
        "extra_expected": extra, "rng_restored": got_rng == rng_next,
        "next_loss": step(fresh, fresh_opt, fresh_sched, 1), "ref_next_loss": next_loss,
    }
    print("RESULT " + json.dumps(result, default=str), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
