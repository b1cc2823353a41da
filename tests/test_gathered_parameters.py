"""``deepspeed.zero.GatheredParameters`` on AMSP parameters (integrations/gathered.py [Note:
GatheredParameters under AMSP]): 2 gloo ranks, a routed ``deepspeed.initialize`` (ZeRO stage 3
plus an ``amsp`` block) on tiny-llama, each case against a single-process model of the same seed
(tests/gathered_worker.py).

[Note: tolerances]
fp32: reads, writes and the step after a write equal the single-process reference exactly
(observed 0.0; two ranks of one micro-batch each against their mean). bf16: the shards hold the
bf16 of what the modifier wrote exactly, the masters the fp32 of the shards exactly, and the
written tensor moves by about lr (1e-2) in the next step; without the master write it jumps
back to its old value (observed 0.15 from the written one, 0.01 with it).
"""

from __future__ import annotations

import json

import pytest
from dist_utils import run_ranks

pytestmark = pytest.mark.distributed

SHARDED, WHOLE = "p=2x1,g=2x1,os=2x1", "p=1x1,g=2x1,os=2x1"


def launch(plans, cases, *extra):
    """``{plan: {case: result}}`` of one launch running each plan's cases in turn."""
    proc = run_ranks(2, "tests.gathered_worker", ";".join(plans), ";".join(cases), *extra, timeout=400,
                     preload="torch,amsp,deepspeed")
    out: dict[str, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("PLAN "):
            plan = out.setdefault(line[len("PLAN "):], {})
        elif line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            plan[r["case"]] = r
    return out


@pytest.fixture(scope="module")
def both():
    return launch([SHARDED, WHOLE], ["read,generate,handle,refuse,write", "read,generate,handle,write"])


@pytest.fixture(scope="module")
def sharded(both):
    return both[SHARDED]


@pytest.fixture(scope="module")
def whole(both):
    return both[WHOLE]


def test_reads_are_the_full_weights_in_one_gather_per_unit(sharded):
    r = sharded["read"]
    assert r["sp"] == 2 and r["plain"] and r["max_abs_diff"] == 0.0 and r["full_max_abs_diff"] == 0.0
    assert r["units"] > r["units_read"] >= 1
    assert r["enter"] == {"all_gather:param_shard": r["units_read"]}  # one per unit holding them
    assert r["nested"] == {"all_gather:param_shard": r["units"] - r["units_read"]}  # the units left
    assert r["innermost"] == {}  # everything gathered already: no collective
    assert r["after_type"] == "DTensor"  # resharded on exit


def test_generation_inside_one_context_gathers_once(sharded):
    r = sharded["generate"]
    assert r["same_tokens"]
    assert r["during"] == {}  # 8 new tokens, no gather per token (before: every unit per token)
    assert r["enter"] == {"all_gather:param_shard": r["units"]}  # one per unit holding parameters
    assert r["total"] == {"all_gather:param_shard": r["units"], "all_reduce:world": 1}  # + exit's flags


def test_modifier_writes_reach_every_shard_and_master(sharded):
    r = sharded["write"]
    assert r["shard_max_abs_diff"] == 0.0 and r["master_max_abs_diff"] == 0.0 and r["masters_checked"] == 6
    assert r["step_loss_diff"] == 0.0 and r["after_step_max_abs_diff"] == 0.0, r
    # one all-gather per unit on enter, the flags, one broadcast of the changed tensors
    assert r["exit"] == {"all_gather:param_shard": r["units_written"], "all_reduce:world": 1,
                         "broadcast:world": 1}


def test_a_handle_taken_before_entering_reads_and_writes_the_full_weight(sharded, whole):
    """OpenRLHF's weight sync ([Note: a handle taken before entering]); before: p.data was the
    sharded DTensor and broadcasting it raised inside DTensor."""
    for r in (sharded["handle"], whole["handle"]):
        assert r["max_abs_diff"] == 0.0 and set(r["read_types"]) <= {"Parameter", "Tensor"}, r
        assert r["written_max_abs_diff"] == 0.0, r  # every shard and the owner's master
    r = sharded["handle"]
    assert r["sp"] == 2 and r["inside"] == ["_GatheredHandle:True"] and r["after"] == ["DTensor"], r
    # a write through the handle without modifier_rank: refused, and it never reached the shards
    # (with sp = 1 such a .data write goes unseen: [Note: what counts as a write])
    msg = r["refused"]
    assert msg and "'model.layers.0.self_attn.q_proj.weight'" in msg and "modifier_rank" in msg, r
    assert "\n" not in msg and r["kept_max_abs_diff"] == 0.0, r


def test_unsupported_uses_are_refused_in_one_line(sharded):
    r = sharded["refuse"]
    m = r["messages"]
    q = "'model.layers.0.self_attn.q_proj.weight'"
    for key in ("no_modifier", "fwd_module", "stale_handle", "reshape"):
        assert m[key] and q in m[key] and "\n" not in m[key], (key, m[key])
    assert "modifier_rank" in m["bad_rank"] and "7" in m["bad_rank"]
    assert r["unchanged_max_abs_diff"] == 0.0 and r["still_sharded"] == "DTensor"


def test_unsharded_plan_reads_and_writes(whole):
    r = whole["read"]
    assert r["sp"] == 1 and r["max_abs_diff"] == 0.0 and r["enter"] == {} and r["nested"] == {}
    g = whole["generate"]
    assert g["same_tokens"] and g["during"] == {} and g["total"] == {"all_reduce:world": 1}
    w = whole["write"]
    assert w["shard_max_abs_diff"] == 0.0 and w["master_max_abs_diff"] == 0.0 and w["masters_checked"] == 3
    assert w["step_loss_diff"] == 0.0 and w["after_step_max_abs_diff"] == 0.0, w
    assert w["exit"] == {"all_reduce:world": 1, "broadcast:world": 1}


@pytest.mark.slow  # its own launch, ~40 s on 2 shared cores; under fp32 the masters are the shards
def test_bf16_writes_reach_the_fp32_masters():
    w = launch([SHARDED], ["write"], "bf16")[SHARDED]["write"]
    assert w["shard_max_abs_diff"] == 0.0 and w["master_max_abs_diff"] == 0.0 and w["masters_checked"] == 6
    assert w["q_moved_by_step"] < 0.02, w  # from the written value; without the master: ~0.15
    assert w["step_loss_diff"] < 1e-3 and w["after_step_max_abs_diff"] < 0.05, w
