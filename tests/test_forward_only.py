"""Models sharded without an optimizer (runtime/sync/grad_sync.py [Note: a model without an
optimizer]): a reference, reward or teacher model beside the trained one. 2 gloo ranks under
``ddp``, ``zero3``, ``p=2x1,g=2x1,os=2x1`` and ``p=1x1,g=1x1,os=2x1``, 4 ranks (2 x 2) under
``p=2x1,g=2x1,os=2x2`` (tests/forward_only_worker.py), fp32, against one process:

- the forward, in train and eval mode, with and without grad, equals the unsharded model's;
- only the p factors shard it (g and os ignored); it stores its parameter shard and nothing
  else: no gradient, master or optimizer bytes (the shard counted by hand: FSDP2's torch.chunk
  rows);
- a backward through it stops in one line naming the model;
- greedy ``generate()`` gives the unsharded model's tokens, on every rank (and so does the trained
  policy below, after its steps);
- a trained policy beside a forward-only reference of the same weights (a DPO-like loss reading
  the reference's log-probs under no_grad) trains three SGD steps as one process (1e-6).
"""

from __future__ import annotations

import json

import pytest

from dist_utils import run_ranks

pytestmark = pytest.mark.distributed

TWO = ("ddp", "zero3", "p=2x1,g=2x1,os=2x1", "p=1x1,g=1x1,os=2x1")
FOUR = ("p=2x1,g=2x1,os=2x2",)
# tiny-llama's parameters, as (dim 0, elements per row): embedding, 2 layers, final norm, head
SHAPES = [(256, 64)] + 2 * [(64, 64), (32, 64), (32, 64), (64, 64), (176, 64), (176, 64), (64, 176), (64, 1),
                            (64, 1)] + [(64, 1), (256, 64)]


def _results(nproc, plans):
    proc = run_ranks(nproc, "tests.forward_only_worker", "2", ";".join(plans), timeout=400)
    out = {r["plan"]: r for r in (json.loads(l[7:]) for l in proc.stdout.splitlines()
                                  if l.startswith("RESULT "))}
    out.update({"frozen": json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("FROZEN ")})
    return out


@pytest.fixture(scope="module")
def results():
    return {**_results(2, TWO), **_results(4, FOUR)}


def test_plan_auto_counts_the_forward_only_engines_beside_it(results):
    """planner/specs.py [Note: frozen models]: a policy planned after its forward-only reference
    (TRL's order) is priced with it; before it, with none; an explicit count wins."""
    assert results["frozen"] == {"case": "frozen_counted", "before": 0, "after": 1, "told": 3}


def _shard_rows(d0: int, sp: int, index: int) -> int:
    """FSDP2's rows of dim 0 on shard ``index`` of ``sp`` (torch.chunk: ceil-sized chunks)."""
    step = -(-d0 // sp)
    return max(0, min(step, d0 - index * step))


@pytest.mark.parametrize("plan", TWO + FOUR)
def test_forward_only_model_runs_as_the_unsharded_one_and_keeps_only_its_shard(results, plan):
    r = results[plan]
    assert r["optimizer"] is True  # shard() returned no optimizer
    sp = 2 if plan.startswith(("zero3", "p=2x1")) else 1
    assert r["run_plan"] == f"p={sp}x1,g={sp}x1,os={sp}x1"  # g and os ignored
    assert r["forward_diff"] <= 1e-6 and r["weights_diff"] == 0.0, r
    assert r["generate_same"], r
    by_hand = 4 * sum(_shard_rows(d0, sp, 0) * row for d0, row in SHAPES)
    assert r["local_param_bytes"] == by_hand
    assert r["state_bytes"] == {"params": by_hand, "grads": 0, "master": 0, "optim_states": 0, "total": by_hand}
    assert r["sharded_after_fused_forward"], r  # a head read by a fused loss is resharded after the forward


@pytest.mark.parametrize("plan", TWO + FOUR)
def test_backward_through_a_forward_only_model_is_one_line_naming_it(results, plan):
    err = results[plan]["backward"]
    assert err and "LlamaForCausalLM" in err and "without an optimizer" in err and "\n" not in err, err


@pytest.mark.parametrize("plan", TWO + FOUR)
def test_a_policy_trains_beside_its_forward_only_reference_as_one_process(results, plan):
    assert results[plan]["policy_with_reference"] <= 1e-6
