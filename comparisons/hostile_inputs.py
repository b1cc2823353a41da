"""Hostile-input sweep (issue 21): a table of malformed inputs across `amsp train/plan/migrate/
simulate/tune/dryrun/compare/checkpoint`, config files (ds_config, HF config.json, profiles),
the Python API and checkpoints (damaged, tampered, pickle-planted, old format, wrongly signed),
each run in its own process with a timeout, as a user would meet it.

    python comparisons/hostile_inputs.py --out comparisons/results/hostile_inputs_<date>.md [--jobs 2]

Classification rule (one per case, first that applies):
- ``hang``: the process did not exit within ``--timeout`` seconds (its process group is killed);
- ``traceback``: ``Traceback (most recent call last)`` appears in its stdout or stderr;
- ``code ran``: a pickle planted in the input was executed (its marker file exists);
- ``silent``: it exited 0 (a CLI run that accepted the input / an API call that returned);
- ``one line``: it exited non-zero and wrote exactly one non-empty line to stderr;
- ``not one line``: any other non-zero exit (several lines, or none).
For an API case the child calls the function and, if it raises ValueError (the project's error
type for bad input; CheckpointError and WireError are ValueErrors), prints
``<Type>: <message>`` and exits 2; any other exception propagates (a traceback). ``names it``
says whether the line contains the case's expected text (the field, file or allowed values).

The cases of tests/test_bad_inputs.py are included (same ids), plus the ones below. The child
processes run the console entry point ``python -m amsp_ext.cli.main`` (what ``amsp`` runs).
Every case is expected to fail before any rank starts; none needs the CPU lock.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

TRAIN = ["train", "--steps", "2"]
SIM = ["simulate", "--no-write", "--no-plot"]
DRY0 = ["dryrun", "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "32"]  # required; a case overrides one
DRY = [*DRY0, "--model", "tiny-llama"]
# `amsp tune` runs on every rank: these cases get one rank's torchrun environment (a 1-rank world)
RANK_ENV_CASES = {"tune:plans-garbage", "tune:plans-too-big", "tune:model-config-heads-0"}

# (id, argv after `amsp`, expected text in the one line)
EXTRA_CLI = [
    # amsp compare
    ("compare:systems-unknown", ["compare", "--systems", "nosuch"], "nosuch"),
    ("compare:systems-empty", ["compare", "--systems", ""], "--systems"),
    ("compare:steps-0", ["compare", "--steps", "0"], "--steps"),
    ("compare:steps-negative", ["compare", "--steps", "-3"], "--steps"),
    ("compare:warmup-negative", ["compare", "--warmup-steps", "-1"], "--warmup-steps"),
    ("compare:nproc-0", ["compare", "--nproc-per-node", "0"], "--nproc-per-node"),
    ("compare:model-unknown", ["compare", "--model", "gpt-5"], "gpt-5"),
    ("compare:precision-fp8", ["compare", "--precision", "fp8"], "fp8"),
    ("compare:plan-garbage", ["compare", "--amsp-plan", "p=2"], "plan"),
    ("compare:repeats-0", ["compare", "--repeats", "0"], "--repeats"),
    ("compare:timeout-negative", ["compare", "--timeout", "-1"], "--timeout"),
    ("compare:timeout-nan", ["compare", "--timeout", "nan"], "--timeout"),
    ("compare:memory-no-unit", ["compare", "--gpu-memory", "80"], "--gpu-memory"),
    ("compare:out-a-file", ["compare", "--out", "{a_file}"], "a_file"),
    ("compare:mode-unknown", ["compare", "--mode", "nosuch"], "invalid choice"),
    ("compare:micro-batch-0", ["compare", "--micro-batch-size", "0"], "--micro-batch-size"),
    ("compare:seq-len-0", ["compare", "--seq-len", "0"], "--seq-len"),
    ("compare:mics-0", ["compare", "--mics-shard-size", "0"], "mics"),
    ("compare:profile-unknown", ["compare", "--profile", "nosuch"], "nosuch"),
    ("compare:launcher-unknown", ["compare", "--launcher", "ssh"], "invalid choice"),
    # amsp dryrun
    ("dryrun:nodes-0", DRY + ["--nodes", "0"], "--nodes"),
    ("dryrun:steps-0", DRY + ["--steps", "0"], "--steps"),
    ("dryrun:plan-garbage", DRY + ["--plan", "p=3"], "plan"),
    ("dryrun:model-unknown", DRY + ["--model", "gpt-5"], "gpt-5"),
    ("dryrun:memory-garbage", DRY + ["--gpu-memory", "x"], "--gpu-memory"),
    ("dryrun:seq-len-negative", DRY + ["--seq-len", "-1"], "--seq-len"),
    ("dryrun:micro-batch-0", DRY + ["--micro-batch-size", "0"], "--micro-batch-size"),
    ("dryrun:out-a-file", DRY + ["--out", "{a_file}"], "a_file"),
    ("dryrun:precision-fp8", DRY + ["--precision", "fp8"], "invalid choice"),
    ("dryrun:bucket-0", DRY + ["--grad-bucket-bytes", "0B"], "--grad-bucket-bytes"),
    ("dryrun:model-config-list", DRY0 + ["--model-config", "{list_json}"], "list_json.json"),
    ("dryrun:profile-truncated", DRY + ["--profile", "{truncated_profile}"], "not valid JSON"),
    ("dryrun:nodes-per-leaf-0", DRY + ["--nodes-per-leaf", "0"], "--nodes-per-leaf"),
    ("dryrun:ranks-garbage", DRY + ["--ranks", "x,y"], "--ranks"),
    # amsp simulate
    ("simulate:model-unknown", SIM + ["--models", "nosuch"], "nosuch"),
    ("simulate:gpus-0", SIM + ["--gpus", "0"], "--gpus"),
    ("simulate:gpus-garbage", SIM + ["--gpus", "abc"], "--gpus"),
    ("simulate:gpus-per-node-0", SIM + ["--gpus-per-node", "0"], "--gpus-per-node"),
    ("simulate:memory-negative", SIM + ["--gpu-memory", "-1GiB"], "--gpu-memory"),
    ("simulate:seq-len-0", SIM + ["--seq-len", "0"], "--seq-len"),
    ("simulate:tokens-0", SIM + ["--global-batch-tokens", "0"], "--global-batch-tokens"),
    ("simulate:efficiency-0", SIM + ["--efficiency", "0"], "efficiency"),
    ("simulate:efficiency-nan", SIM + ["--efficiency", "nan"], "efficiency"),
    ("simulate:profile-unknown", SIM + ["--profile", "nosuch"], "nosuch"),
    ("simulate:profile-list", SIM + ["--profile", "{list_json}"], "list_json.json"),
    # amsp tune
    ("tune:plans-garbage", ["tune", "--plans", "foo;bar"], "foo"),
    ("tune:plans-too-big", ["tune", "--plans", "p=16x1,g=16x1,os=16x1"], "R="),
    ("tune:steps-0", ["tune", "--steps", "0"], "--steps"),
    ("tune:repeats-0", ["tune", "--repeats", "0"], "--repeats"),
    ("tune:top-0", ["tune", "--top", "0"], "--top"),
    ("tune:model-unknown", ["tune", "--model", "gpt-5"], "invalid choice"),
    ("tune:peak-nan", ["tune", "--peak-tflops", "nan"], "--peak-tflops"),
    ("tune:probe-steps-negative", ["tune", "--probe-steps", "-1"], "--probe-steps"),
    ("tune:memory-no-unit", ["tune", "--gpu-memory", "5"], "--gpu-memory"),
    ("tune:objective-unknown", ["tune", "--objective", "speed"], "invalid choice"),
    ("tune:model-config-heads-0", ["tune", "--model-config", "{hf_heads_0}"], "num_attention_heads"),
    # amsp train: more flags
    ("train:lr-negative", TRAIN + ["--lr", "-1"], "--lr"),
    ("train:lr-inf", TRAIN + ["--lr", "inf"], "--lr"),
    ("train:beta1-1.5", TRAIN + ["--beta1", "1.5"], "--beta1"),
    ("train:beta2-negative", TRAIN + ["--beta2", "-0.1"], "--beta2"),
    ("train:weight-decay-negative", TRAIN + ["--weight-decay", "-1"], "--weight-decay"),
    ("train:warmup-negative", TRAIN + ["--warmup-steps", "-1"], "--warmup-steps"),
    ("train:micro-batches-0", TRAIN + ["--micro-batches", "0"], "--micro-batches"),
    ("train:seq-len-0", TRAIN + ["--seq-len", "0"], "--seq-len"),
    ("train:nproc-0", TRAIN + ["--nproc-per-node", "0"], "--nproc-per-node"),
    ("train:fp16-scale-0", TRAIN + ["--precision", "fp16", "--fp16-initial-scale", "0"], "initial"),
    ("train:fp16-growth-0.5", TRAIN + ["--precision", "fp16", "--fp16-growth-factor", "0.5"], "growth"),
    ("train:fp16-backoff-2", TRAIN + ["--precision", "fp16", "--fp16-backoff-factor", "2"], "backoff"),
    ("train:fp16-interval-0", TRAIN + ["--precision", "fp16", "--fp16-growth-interval", "0"], "interval"),
    ("train:fp16-min-scale-negative", TRAIN + ["--precision", "fp16", "--fp16-min-scale", "-1"], "min"),
    ("train:broadcast-bucket-negative", TRAIN + ["--broadcast-bucket-bytes", "-1B"], "--broadcast-bucket-bytes"),
    ("train:nodes-per-leaf-0", TRAIN + ["--nodes-per-leaf", "0"], "--nodes-per-leaf"),
    ("train:checkpoint-key-empty", TRAIN + ["--checkpoint-key", ""], "--checkpoint-key"),
    ("train:adaptive-hysteresis-negative", TRAIN + ["--adaptive", "--adaptive-hysteresis", "-1"], "hysteresis"),
    ("train:reserve-huge", TRAIN + ["--plan", "auto", "--gpu-memory", "4MiB", "--memory-reserve", "1" + "0" * 400 + "GiB"],
     "--memory-reserve"),
    ("train:memory-huge", TRAIN + ["--plan", "auto", "--gpu-memory", "9" * 300 + "GiB"], "--gpu-memory"),
    ("train:grad-accum-text", TRAIN + ["--micro-batches", "two"], "invalid int value"),
    ("train:unknown-flag", TRAIN + ["--learning-rate", "1"], "unrecognized arguments"),
    ("train:precision-fp8", TRAIN + ["--precision", "fp8"], "invalid choice"),
    ("train:granularity-unknown", TRAIN + ["--granularity", "block"], "invalid choice"),
    # checkpoints met by `amsp train --resume` (checked by the launcher, before any rank)
    ("train:resume-old-format", TRAIN + ["--resume", "{old_ckpt}"], "amsp checkpoint convert --trust"),
    ("train:resume-old-format-bomb", TRAIN + ["--resume", "{old_bomb}"], "amsp checkpoint convert --trust"),
    ("train:resume-a-file", TRAIN + ["--resume", "{a_file}"], "a_file"),
    ("train:resume-flipped-tensor-byte", TRAIN + ["--resume", "{ck_flipped}"], "sha256 mismatch"),
    ("train:resume-truncated-tensor", TRAIN + ["--resume", "{ck_truncated}"], "truncated"),
    ("train:resume-no-amsp-json", TRAIN + ["--resume", "{ck_no_meta}"], "amsp.json"),
    ("train:resume-extra-tensor-file", TRAIN + ["--resume", "{ck_extra_file}"], "not one this checkpoint wrote"),
    ("train:resume-unsigned-keyed", TRAIN + ["--resume", "{ck_good}", "--checkpoint-key", "key-B"], "not signed"),
    ("train:resume-wrong-key", TRAIN + ["--resume", "{ck_signed}", "--checkpoint-key", "key-B"], "another key"),
    ("train:resume-damaged-rng", TRAIN + ["--resume", "{ck_bad_rng}"], "rng-0.json"),
    ("train:resume-missing-state", TRAIN + ["--resume", "{ck_no_state}"], "amsp.state.json"),
    # amsp checkpoint convert
    ("checkpoint:no-action", ["checkpoint"], "required"),
    ("checkpoint:convert-no-args", ["checkpoint", "convert"], "required"),
    ("checkpoint:convert-untrusted", ["checkpoint", "convert", "{old_ckpt}", "{new_dst}"], "--trust"),
    ("checkpoint:convert-untrusted-bomb", ["checkpoint", "convert", "{old_bomb}", "{new_dst}"], "--trust"),
    ("checkpoint:convert-missing", ["checkpoint", "convert", "--trust", "{no_dir}", "{new_dst}"], "not a directory"),
    ("checkpoint:convert-a-file", ["checkpoint", "convert", "--trust", "{a_file}", "{new_dst}"], "not a directory"),
    ("checkpoint:convert-current", ["checkpoint", "convert", "--trust", "{ck_good}", "{new_dst}"], "already"),
    ("checkpoint:convert-dst-exists", ["checkpoint", "convert", "--trust", "{old_ckpt}", "{ck_good}"], "exists"),
    ("checkpoint:convert-dst-parent-missing", ["checkpoint", "convert", "--trust", "{old_ckpt}", "{no_dir}/x"],
     "not a directory"),
    ("checkpoint:convert-not-a-checkpoint", ["checkpoint", "convert", "--trust", "{ckpt_nometa}", "{new_dst}"],
     "amsp.json"),
    ("checkpoint:convert-bad-json", ["checkpoint", "convert", "--trust", "{ckpt_badjson}", "{new_dst}"], "JSON"),
    ("checkpoint:convert-damaged-old", ["checkpoint", "convert", "--trust", "{old_damaged}", "{new_dst}"], "sha256"),
    ("checkpoint:convert-empty-key", ["checkpoint", "convert", "--trust", "--checkpoint-key", "", "{old_ckpt}",
                                      "{new_dst}"], "--checkpoint-key"),
]

# (id, Python source evaluated in the child with F = the files table, expected text)
EXTRA_PY = [
    ("ShardConfig:precision-none", "_cfg(precision=None)", "config.precision"),
    ("ShardConfig:timeout-str", "_cfg(timeout='10')", "config.timeout"),
    ("ShardConfig:gpus-2.5", "_cfg(gpus_per_node=2.5)", "config.gpus_per_node"),
    ("ShardConfig:granularity-int", "_cfg(granularity=3)", "config.granularity"),
    ("ShardConfig:reduce-dtype", "_cfg(reduce_dtype='fp8')", "reduce_dtype"),
    ("FP16Config:growth-1", "_fp16(growth_factor=1.0)", "fp16.growth_factor"),
    ("FP16Config:scale-negative", "_fp16(initial_scale=-1)", "fp16.initial_scale"),
    ("FP16Config:min-scale-nan", "_fp16(min_scale=math.nan)", "fp16.min_scale"),
    ("AutoPlanConfig:micro-batch-0", "_auto(seq_len=16, micro_batch_size=0)", "micro_batch_size"),
    ("AutoPlanConfig:seq-len-str", "_auto(seq_len='x')", "auto.seq_len"),
    ("AdaptiveConfig:band-short", "_adaptive(band=(0.5,))", "adaptive.band"),
    ("AdaptiveConfig:window-bool", "_adaptive(window=True)", "adaptive.window"),
    ("OverlapConfig:int", "_overlap(allreduce=1)", "overlap.allreduce"),
    ("plan:parse-zero-factor", "_plan('p=0x1,g=1x1,os=1x1')", "p="),
    ("plan:parse-empty", "_plan('')", "plan"),
    ("plan:parse-mics-0", "_plan('mics:0')", "mics"),
    ("checkpoint:load-unsharded", "_load_plain(F['ck_good'])", "not sharded by amsp_ext.shard"),
    ("checkpoint:save-unsharded", "_save_plain(F['no_dir'])", "not sharded by amsp_ext.shard"),
    ("checkpoint:export-missing", "_export(F['no_dir'])", "does not exist"),
    ("checkpoint:export-a-file", "_export(F['a_file'])", "not a directory"),
    ("checkpoint:export-old-format", "_export(F['old_ckpt'])", "amsp checkpoint convert --trust"),
    ("checkpoint:export-pickle-tensor-file", "_export(F['ck_bomb_tensor'])", "tensor file"),
    ("checkpoint:verify-pickle-state", "_load_state(F['ck_bomb_state'])", "amsp.state.json"),
    ("checkpoint:verify-pickle-rng", "_load_rng(F['ck_bomb_rng'])", "rng-0.json"),
    ("checkpoint:verify-wrong-key", "_keyed(F['ck_signed'], 'key-B')", "another key"),
    ("checkpoint:verify-unsigned-keyed", "_keyed(F['ck_good'], 'key-B')", "not signed"),
    ("checkpoint:verify-tampered-signed", "_keyed(F['ck_tampered_signed'], 'key-A')", "another key"),
    ("checkpoint:convert-untrusted-api", "_convert(F['old_bomb'], F['new_dst'], False)", "--trust"),
    ("checkpoint:convert-missing-api", "_convert(F['no_dir'], F['new_dst'], True)", "not a directory"),
    ("wire:pickle-bytes", "_wire_loads(PICKLE_BOMB)", "not amsp data"),
    ("wire:truncated-json", "_wire_loads(b'[1,')", "not amsp data"),
    ("wire:tensor-short-data", "_wire_loads(b'{\"__tensor__\": {\"dtype\": \"float32\", \"shape\": [3], \"data\": \"AAAA\"}}')",
     "not amsp data"),
    ("wire:unknown-dtype", "_wire_loads(b'{\"__dtype__\": \"evil\"}')", "unknown dtype"),
    ("wire:tensor-bad-base64", "_wire_loads(b'{\"__tensor__\": {\"dtype\": \"float32\", \"shape\": [1], \"data\": \"!!\"}}')",
     "not amsp data"),
    ("wire:object-not-data", "_wire_dumps({'f': object()})", "cannot be stored"),
]


# -- helpers the API cases call (in the child) ------------------------------------------------------
def _plan(text):
    from amsp_ext.planner.plan import parse_plan

    return parse_plan(text)


def _load_plain(path):
    import torch

    from amsp_ext.runtime.state.checkpoint import load_checkpoint

    return load_checkpoint(torch.nn.Linear(2, 2), None, path)


def _save_plain(path):
    import torch

    from amsp_ext.runtime.state.checkpoint import save_checkpoint

    return save_checkpoint(torch.nn.Linear(2, 2), None, path)


def _export(path):
    from amsp_ext.runtime.state.export import export_checkpoint

    return export_checkpoint(path)


def _load_state(path):
    """What load_checkpoint does with amsp.state.json before any collective."""
    from amsp_ext.runtime.state.checkpoint import _read_json, read_checkpoint_meta
    from amsp_ext.runtime.state.checkpoint_files import STATE_FILE

    read_checkpoint_meta(path)
    return _read_json(Path(path), STATE_FILE)


def _load_rng(path):
    from amsp_ext.runtime.state.checkpoint import _read_json, read_checkpoint_meta

    read_checkpoint_meta(path)
    return _read_json(Path(path), "rng-0.json")


def _keyed(path, key):
    os.environ["AMSP_CHECKPOINT_KEY"] = key
    from amsp_ext.runtime.state.checkpoint import verify_checkpoint

    return verify_checkpoint(path)


def _convert(src, dst, trust):
    from amsp_ext.runtime.state.convert import convert_checkpoint

    return convert_checkpoint(src, dst, trust=trust)


def _wire_loads(data):
    from amsp_ext.runtime import wire

    return wire.loads(data)


def _wire_dumps(obj):
    from amsp_ext.runtime import wire

    return wire.dumps(obj)


class _Bomb:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# -- the checkpoints (built once, in a child process) -----------------------------------------------
def _make_checkpoints(root: Path) -> None:
    """A real 1-rank checkpoint and its hostile variants; an old-format one (tests/convert_worker.py)."""
    import pickle

    import torch.distributed as dist

    from amsp_ext.runtime.state.checkpoint import save_checkpoint
    from checkpoint_worker import _retable
    from convert_worker import make, step, write_old

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    model, opt, sched = make(0)
    step(model, opt, sched, 0)
    save_checkpoint(model, opt, root / "ck_good", lr_scheduler=sched, extra={"n": 1})
    write_old(model, opt, sched, root / "old_ckpt", {"n": 1})
    dist.destroy_process_group()
    bomb = pickle.dumps(_Bomb(str(root / "PWNED")))
    good = root / "ck_good"
    tensor = min(good.glob("*.safetensors")).name

    def copy(name, src=good):
        shutil.copytree(src, root / name)
        return root / name

    d = copy("ck_flipped")
    data = bytearray((d / tensor).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / tensor).write_bytes(bytes(data))
    d = copy("ck_truncated")
    (d / tensor).write_bytes((d / tensor).read_bytes()[:100])
    d = copy("ck_no_meta")
    (d / "amsp.json").unlink()
    d = copy("ck_extra_file")
    shutil.copy(d / tensor, d / "shard-00009-model-00001-of-00001.safetensors")
    d = copy("ck_bad_rng")
    (d / "rng-0.json").write_text("{}")
    d = copy("ck_no_state")
    (d / "amsp.state.json").unlink()
    for name, target in (("ck_bomb_tensor", tensor), ("ck_bomb_state", "amsp.state.json"),
                         ("ck_bomb_rng", "rng-0.json")):
        d = copy(name)
        (d / target).write_bytes(bomb)
        _retable(d)  # checksums recomputed: only the format stands between the pickle and a load
    d = copy("ck_signed")
    _retable(d, key="key-A")
    d = copy("ck_tampered_signed")
    _retable(d, key="key-A")
    (d / "rng-0.json").write_bytes(bomb)
    _retable(d, keep_signature=True)
    d = copy("old_bomb", root / "old_ckpt")
    (d / ".metadata").write_bytes(bomb)
    _retable(d, fmt="amsp-checkpoint/2")
    d = copy("old_damaged", root / "old_ckpt")
    (d / ".metadata").write_bytes(b"x" + (d / ".metadata").read_bytes()[1:])


def _all_files(tmp: Path) -> dict[str, str]:
    import test_bad_inputs as T

    files = {k: str(v) for k, v in T._files(tmp).items()}
    ck = tmp / "ck"
    ck.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    env.pop("AMSP_CHECKPOINT_KEY", None)
    p = subprocess.run([sys.executable, __file__, "--make-checkpoints", str(ck)], env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    if p.returncode != 0:
        raise SystemExit(f"hostile_inputs: building the checkpoints failed:\n{p.stderr[-3000:]}")
    for d in sorted(ck.iterdir()):
        files[d.name] = str(d)
    files["new_dst"] = str(tmp / "converted")
    files["marker"] = str(ck / "PWNED")
    return files


def cases() -> list[tuple[str, str, object, str]]:
    import test_bad_inputs as T

    out = [(c, "cli", argv, want) for c, argv, want in T.CLI]
    out += [(c, "py-table", c, want) for c, _, want in T.PY]
    have = {c[0] for c in out}  # a case that moved into the test table runs once, from there
    out += [(c, "cli", argv, want) for c, argv, want in EXTRA_CLI if c not in have]
    out += [(c, "py", src, want) for c, src, want in EXTRA_PY if c not in have]
    ids = [c[0] for c in out]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise SystemExit(f"hostile_inputs: duplicate case ids {dup}")
    return out


# -- the child ---------------------------------------------------------------------------------------
def child(kind: str, what: str, files: dict[str, str]) -> int:
    import pickle

    import test_bad_inputs as T

    ns = {**{k: getattr(T, k) for k in dir(T) if k.startswith("_")}, **globals(), "math": math,
          "F": {k: Path(v) for k, v in files.items()},
          "PICKLE_BOMB": pickle.dumps(_Bomb(files["marker"]))}
    try:
        if kind == "py-table":
            fn = dict((c, f) for c, f, _ in T.PY)[what]
            fn(ns["F"])
        else:
            eval(what, ns)  # noqa: S307 - the table's own source, not input
    except ValueError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


def run_case(case, files: dict[str, str], timeout: float) -> dict:
    cid, kind, what, want = case
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    env.pop("AMSP_CHECKPOINT_KEY", None)
    if cid in RANK_ENV_CASES:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    if kind == "cli":
        argv = [a.format(**files) for a in what]
        cmd = [sys.executable, "-m", "amsp_ext.cli.main", *argv]
        shown = "amsp " + " ".join(a if a and " " not in a else repr(a) for a in what)
    else:
        cmd = [sys.executable, __file__, "--child", kind, what, "--files", json.dumps(files)]
        shown = what if kind == "py" else f"tests/test_bad_inputs.py PY[{what!r}]"
    marker = Path(files["marker"])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    wall = time.perf_counter() - t0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if rc is None:
        verdict = "hang"
    elif "Traceback (most recent call last)" in out + err:
        verdict = "traceback"
    elif marker.exists():
        verdict = "code ran"
    elif rc == 0:
        verdict = "silent"
    elif len(lines) == 1:
        verdict = "one line"
    else:
        verdict = "not one line"
    return {"id": cid, "input": shown, "verdict": verdict, "rc": rc, "seconds": round(wall, 1),
            "line": lines[-1] if lines else "", "lines": len(lines), "names_it": bool(lines) and want in lines[-1],
            "want": want, "stderr_tail": err[-2000:] if verdict not in ("one line",) else ""}


def report(results: list[dict], out: Path, argv: list[str], wall: float) -> None:
    from collections import Counter

    n = len(results)
    c = Counter(r["verdict"] for r in results)
    named = sum(r["names_it"] for r in results if r["verdict"] == "one line")
    date = datetime.date.today().isoformat()
    rows = [f"# Hostile-input sweep, {date}", "",
            f"Command: `python comparisons/hostile_inputs.py {' '.join(argv)}` (from the repository root; "
            f"{n} cases, {wall:.0f} s wall).", "",
            "Classification rule (comparisons/hostile_inputs.py): hang = no exit within the timeout; "
            "traceback = `Traceback (most recent call last)` in the output; code ran = a planted pickle's "
            "marker file exists; silent = exit 0; one line = non-zero exit with exactly one non-empty stderr "
            "line; not one line = any other non-zero exit.", "",
            "| verdict | cases | share |", "|---|---|---|"]
    for v in ("one line", "not one line", "traceback", "silent", "hang", "code ran"):
        rows.append(f"| {v} | {c.get(v, 0)} | {100 * c.get(v, 0) / n:.1f} % |")
    rows += ["", f"Of the one-line errors, {named} contain the case's expected text (field, file or allowed "
                 f"values); the others are listed with their line below.", ""]
    bad = [r for r in results if r["verdict"] != "one line" or not r["names_it"]]
    if bad:
        rows += ["## Cases that are not a one-line error naming what is wrong", "",
                 "| id | verdict | expected text | what it printed |", "|---|---|---|---|"]
        for r in bad:
            rows.append(f"| {r['id']} | {r['verdict']} | `{r['want']}` | {_md(r['line'] or r['stderr_tail'][-300:])} |")
        rows.append("")
    rows += ["## Every case", "", "| id | input | verdict | s | the line |", "|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['id']} | {_md(r['input'][:160])} | {r['verdict']} | {r['seconds']} | {_md(r['line'][:300])} |")
    out.write_text("\n".join(rows) + "\n")
    (out.with_suffix(".json")).write_text(json.dumps(results, indent=1))


def _md(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`" if text else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="the Markdown report (a .json with every result beside it)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=90, help="seconds per case before it counts as a hang")
    ap.add_argument("--only", default=None, help="run the cases whose id contains this text")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "WHAT"), help=argparse.SUPPRESS)
    ap.add_argument("--files", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--make-checkpoints", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_checkpoints:
        _make_checkpoints(Path(args.make_checkpoints))
        return
    if args.child:
        sys.exit(child(args.child[0], args.child[1], json.loads(args.files)))
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="amsp-hostile-"))
    try:
        files = _all_files(tmp)
        todo = [c for c in cases() if args.only is None or args.only in c[0]]
        with cf.ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda c: run_case(c, files, args.timeout), todo))
            for r in results:
                print(f"{r['verdict']:>12}  {r['seconds']:>5}s  {r['id']}: {r['line'][:150]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    from collections import Counter

    print(dict(Counter(r["verdict"] for r in results)), f"{len(results)} cases, {wall:.0f} s")
    if args.out:
        shown = [a for a in sys.argv[1:]]
        report(results, Path(args.out), shown, wall)


if __name__ == "__main__":
    main()
