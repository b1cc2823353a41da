"""`amsp compare --reduce-dtype`: what each row sent, measured from its trace, against hand-computed
bytes (4 B or 2 B x the parameters each reduction reduces, the parameters counted from the model
itself); the report refusing a ratio of rows that sent different bytes (a crafted results.json);
and the statistics a claim needs (hand-made per-round ratios)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from amsp_ext.compare.config import RunSpec, SpecError
from amsp_ext.compare.rounds import overloaded_rounds, paired_ratio, verdict
from amsp_ext.compare.wire import wire_of

RESULTS = Path(__file__).resolve().parents[1] / "comparisons" / "results"


def _coll(op, kind, full_bytes, dtype="fp32", label=""):
    return SimpleNamespace(op=op, kind=kind, full_bytes=full_bytes, elem_bytes=4 if dtype == "fp32" else 2,
                           dtype=dtype, label=label)


def test_a_two_level_all_reduce_counts_its_gradient_once():
    """DDP's plan run two-level (reduce-scatter in the node, all-reduce of the half across, gather
    back) reduces the same 1,000-byte gradient as DDP's flat all-reduce: 1,000 gradient bytes, not
    1,500; the bytes each level moved stay in bytes_per_step."""
    two = wire_of([_coll("all_reduce", "AR", 1000, label="amsp::all_reduce::param_replica_local[0,1]"),
                   _coll("all_reduce", "AR", 500, label="amsp::all_reduce::param_replica_node[0,2]"),
                   _coll("all_gather", "AR", 1000, label="amsp::all_gather::param_replica_local[0,1]")])
    flat = wire_of([_coll("all_reduce", "AR", 1000, label="DistributedDataParallel.backward")])
    assert two["grad_bytes_per_step"] == flat["grad_bytes_per_step"] == 1000
    assert two["bytes_per_step"] == {"all_gather": 1000, "all_reduce": 1500}


def test_an_auto_rows_shape_is_the_plan_that_ran():
    """`--amsp-plan auto` picked DDP's plan on 2 x 2: the row is DDP's shape, so a ratio to DDP is
    checked for bytes; other factors have no named shape and are checked by dtype only."""
    from amsp_ext.compare.wire import plan_shape, wire_mismatch

    def row(system, label, plan=None, grad=1000):
        return {"system": system, "label": label, "spec": {"amsp_plan": "auto"}, "gpus_per_node": 2,
                "num_nodes": 2, "settings": {"plan": plan} if plan else {},
                "wire": {"grad_dtype": "fp32", "grad_bytes_per_step": grad}}

    pick = row("amsp-plan", "AMSP pick", "p=1x1,g=1x1,os=1x1")
    assert plan_shape(pick) == "ddp" and plan_shape(row("amsp-plan", "x", "p=2x1,g=2x1,os=2x1")) == "mics"
    assert plan_shape(row("amsp-plan", "x", "p=1x1,g=1x1,os=2x1")) is None
    assert wire_mismatch(pick, row("ddp", "DDP")) is None
    assert "same plan shape (ddp)" in wire_mismatch(row("amsp-plan", "AMSP pick", "p=1x1,g=1x1,os=1x1", 1500),
                                                    row("ddp", "DDP"))


def test_wire_counts_reduction_inputs_and_leaves_scalars_out():
    w = wire_of([_coll("reduce_scatter", "RS", 800, "bf16"), _coll("reduce_scatter", "RS", 800, "bf16"),
                 _coll("all_reduce", "AR", 400, "bf16"), _coll("all_gather", "AG", 800, "bf16"),
                 _coll("all_reduce", "AR", 4), _coll("all_reduce", "other", 84),
                 _coll("all_gather", "AR", 800, "bf16")])  # a two-level all-reduce's gather back
    assert w["grad_bytes_per_step"] == 2000 and w["grad_dtype"] == "bf16"
    assert w["param_bytes_per_step"] == 800 and w["param_dtype"] == "bf16"
    assert w["bytes_per_step"] == {"all_gather": 1600, "all_reduce": 488, "reduce_scatter": 1600}
    mixed = wire_of([_coll("all_reduce", "AR", 400, "bf16"), _coll("all_reduce", "AR", 800)])
    assert mixed["grad_dtype"] == "bf16+fp32" and mixed["param_dtype"] is None


def test_reduce_dtype_flag_and_its_one_line_error():
    assert RunSpec().reduce_dtype == "fp32" and RunSpec(reduce_dtype="bf16").reduce_dtype == "bf16"
    for kwargs in (dict(precision="fp32", reduce_dtype="bf16"), dict(reduce_dtype="fp16")):
        with pytest.raises(SpecError, match="reduce_dtype") as e:
            RunSpec(**kwargs)
        assert "\n" not in str(e.value)


def test_verdict_needs_ten_steps_five_rounds_and_four_agreeing():
    def rec(per_round):
        a = {"tokens_per_gpu_per_s_rounds": [100.0 * r for r in per_round]}
        return paired_ratio(a, {"tokens_per_gpu_per_s_rounds": [100.0] * len(per_round)})

    met = rec([1.2, 1.1, 0.9, 1.3, 1.05])  # median 1.1, 4 of 5 above 1.0
    assert met["median"] == pytest.approx(1.1) and met["rounds_above_target"] == 4
    assert (met["q1"], met["q3"]) == pytest.approx((1.05, 1.2))
    assert verdict(met, 10)["met"] is True and verdict(met, 10)["claim"] is True
    split = rec([1.2, 1.1, 0.9, 0.95, 1.3])  # median 1.1 but only 3 of 5 above
    assert verdict(split, 10) == {"claim": True, "met": False, "text": (
        "target not met (median 1.10x, 3 of 5 rounds above 1.0x; met needs the median and >= 4 "
        "rounds above it)")}
    assert verdict(met, 9)["claim"] is False and verdict(met, 9)["met"] is None
    assert verdict(rec([1.2, 1.1, 1.3, 1.05]), 20)["text"].startswith("not a claim (20 timed steps, 4 rounds")
    ten = rec([1.2] * 8 + [0.9] * 2)  # 8 of 10 = 80 %
    assert verdict(ten, 10)["met"] is True
    assert verdict(rec([1.2] * 7 + [0.9] * 3), 10)["met"] is False


def test_rounds_started_above_twice_the_cores_are_flagged():
    assert overloaded_rounds([[3.9, 1, 1], None, [4.1, 1, 1], [8.0, 1, 1]], cpu_count=2) == {
        "cpu_count": 2, "overloaded_rounds": [3, 4]}


def _crafted(tmp_path, ddp_wire, amsp_wire):
    """The committed 100 Mbit bf16 replicate run (DDP vs AMSP plan ddp, 4 rounds) with wire
    records put in: the bytes the issue quotes for it, or others."""
    from amsp_ext.compare.report import write_report

    src = RESULTS / "small-llama_cpu-2x2-lab-100mbit_2026-12-04_bf16_replicate" / "results.json"
    data = json.loads(src.read_text())
    by = {r["key"]: r for r in data["rows"]}
    assert by["amsp-plan"]["spec"]["amsp_plan"] == "ddp"  # the same plan shape as DDP
    by["ddp"]["wire"], by["amsp-plan"]["wire"] = ddp_wire, amsp_wire
    crafted = tmp_path / "crafted.json"
    crafted.write_text(json.dumps(data))
    data = json.loads(crafted.read_text())
    path = write_report(rows=data["rows"], meta=data["meta"], out_dir=tmp_path, stem="crafted", plots=False)
    written = json.loads((tmp_path / "crafted" / "results.json").read_text())
    rec = next(r for r in written["ratios"] if (r["numerator"], r["denominator"]) == ("amsp-plan", "ddp"))
    line = next(x for x in path.read_text().splitlines() if x.startswith("- AMSP (plan ddp) / DDP:"))
    return rec, line


def _wire(nbytes, dtype, asked="fp32", ranks=None):
    return {"grad_dtype": dtype, "param_dtype": None, "grad_bytes_per_step": nbytes,
            "param_bytes_per_step": 0, "bytes_per_step": {"all_reduce": nbytes}, "reduce_dtype_asked": asked,
            "grad_bytes_per_step_ranks": ranks}


def test_report_refuses_a_ratio_of_rows_that_sent_different_bytes(tmp_path):
    # what the run really sent (issue 37; no --reduce-dtype then): DDP fp32, AMSP bf16
    rec, line = _crafted(tmp_path, _wire(12_133_376, "fp32", None), _wire(6_066_688, "bf16", None))
    assert rec["refused"] == ("gradients on the wire differ: AMSP (plan ddp) bf16, DDP fp32")
    assert line == "- AMSP (plan ddp) / DDP: no ratio: gradients on the wire differ: AMSP (plan ddp) bf16, DDP fp32"
    assert rec["verdict"]["claim"] is False and rec["verdict"]["met"] is None  # a refused ratio claims nothing
    # the same dtype, half the bytes for the same plan shape: refused, with both figures
    rec, line = _crafted(tmp_path, _wire(12_133_376, "fp32"), _wire(6_066_688, "fp32"))
    assert line == ("- AMSP (plan ddp) / DDP: no ratio: same plan shape (ddp) but gradient bytes per step "
                    "differ by more than 5%: AMSP (plan ddp) 6,066,688 B, DDP 12,133,376 B")
    # a row that did not send the asked dtype is left out of ratios, and its wire row says so
    rec, line = _crafted(tmp_path, _wire(12_133_376, "fp32", "bf16"), _wire(6_066_688, "bf16", "bf16"))
    assert line == "- AMSP (plan ddp) / DDP: no ratio: DDP reduced gradients in fp32, not the asked bf16"
    text = (tmp_path / "crafted.md").read_text()
    assert "| fp32 (bf16) **not as asked: no ratios** |" in text
    # within 5 %: the ratio, its spread and its verdict (2 timed steps, 4 rounds: not a claim)
    rec, line = _crafted(tmp_path, _wire(12_133_376, "fp32"), _wire(12_500_000, "fp32"))
    assert rec["refused"] is None and line.startswith(f"- AMSP (plan ddp) / DDP: {rec['median']:.2f}x (median of 4")
    assert line.endswith("not a claim (2 timed steps, 4 rounds; a claim needs >= 10 timed steps and >= 5 rounds)")
    # rank 0 agrees with DDP, but the row's other ranks read a bucket more: its bytes cannot vouch
    rec, line = _crafted(tmp_path, _wire(12_133_376, "fp32", ranks=[12_133_376] * 4),
                         _wire(12_133_376, "fp32", ranks=[12_133_376, 13_453_824, 12_133_376, 12_133_376]))
    assert line == ("- AMSP (plan ddp) / DDP: no ratio: same plan shape (ddp) but AMSP (plan ddp)'s ranks and "
                    "rounds counted 12,133,376-13,453,824 gradient bytes per step: not read alike")


# -- end to end: 4 ranks as 2 nodes x 2, bf16 compute ---------------------------------------------
def _num_params(model_name: str) -> tuple[int, int]:
    """(all parameters, those of one decoder layer), counted from the model itself."""
    from amsp_ext.common.models import build_llama

    model = build_llama(model_name, seed=0)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert all(sum(p.numel() for p in x.parameters()) == layer for x in model.model.layers)
    return sum(p.numel() for p in model.parameters()), layer


def _num_tensors(model_name: str) -> int:
    from amsp_ext.common.models import build_llama

    return len(list(build_llama(model_name, seed=0).parameters()))


def _expected_grad_bytes(system: str, plan: str | None, *, P: int, M: int, elem: int, shard: int,
                         T: int = 0) -> int:
    """Hand-computed gradient bytes per step (compare/wire.py [Note: bytes on the wire]): each
    reduction's input, element size x the parameters it reduces. AMSP's replica all-reduce
    also carries one flag per tensor, ``T`` (grad_sync.py [Note: a parameter no backward
    reached])."""
    if system in ("ddp", "ddp-bf16"):
        return elem * P  # one bucketed all-reduce of every gradient (no_sync on 0..M-2)
    if system == "amsp-plan" and plan == "ddp":
        return elem * (P + T)
    if system == "hsdp":
        # reduce-scatter of every unit's gradient in the node on every micro-batch, then the
        # shard's all-reduce across nodes on the last
        return elem * (M * P + P // shard)
    raise AssertionError(system)


def _compare(tmp_path, systems, *, reduce_dtype, plan="ddp", limit_rounds=0, num_steps=2):
    from amsp_ext.compare.harness import run_comparison
    from amsp_ext.compare.launch import LaunchConfig

    spec = RunSpec(model="tiny-llama", seq_len=32, micro_batch_size=1, num_micro_batches=2, num_steps=num_steps,
                   num_warmup_steps=1, precision="bf16", reduce_dtype=reduce_dtype, gpus_per_node=2,
                   amsp_plan=plan, amsp_all_reduce="flat", limit_rounds=limit_rounds, dist_timeout_s=120)
    path, rows = run_comparison(mode="baselines", spec=spec, launch=LaunchConfig(nproc_per_node=4, timeout_s=300),
                                out_dir=tmp_path, command="pytest", systems=systems, progress=lambda s: None)
    return spec, path, {r["key"]: r for r in rows}


def _check_bytes(spec, by, systems, elem):
    P, _ = _num_params(spec.model)
    dtype = {4: "fp32", 2: "bf16"}[elem]
    for key in systems:
        row = by[key]
        assert row["status"] == "ok", (key, row.get("reason"))
        w = row["wire"]
        want = _expected_grad_bytes(key, spec.amsp_plan, P=P, M=spec.num_micro_batches, elem=elem,
                                    shard=spec.gpus_per_node, T=_num_tensors(spec.model))
        assert w["grad_bytes_per_step"] == want, (key, w)
        assert set(w["grad_bytes_per_step_ranks"]) == {want}, (key, w)
        assert w["grad_dtype"] == dtype and w["reduce_dtype_asked"] == spec.reduce_dtype, (key, w)
        assert row["mixed_precision"], key


@pytest.mark.distributed
@pytest.mark.slow  # four 4-rank launches, ~70 s: the launch and report reach the default tier through test_compare_harness.py::test_harness_end_to_end_two_ranks, the byte count through test_wire_counts_reduction_inputs_and_leaves_scalars_out
def test_every_row_sends_the_asked_gradient_bytes_bf16(tmp_path):
    """--reduce-dtype bf16: DDP (bf16 hook), DDP over bf16 parameters, HSDP and AMSP's replicate
    plan send 2 B per gradient element; DDP and AMSP's ddp plan, the same shape, get a ratio.
    DDP over bf16 parameters with fp32 masters is AMSP's recipe: their losses agree closely."""
    systems = ["ddp", "ddp-bf16", "hsdp", "amsp-plan"]
    spec, path, by = _compare(tmp_path, systems, reduce_dtype="bf16")
    _check_bytes(spec, by, systems, elem=2)
    assert by["hsdp"]["wire"]["param_dtype"] == "bf16"
    assert "fp32 masters" in by["ddp-bf16"]["mixed_precision"]
    diffs = [abs(a - b) for a, b in zip(by["ddp-bf16"]["loss"], by["amsp-plan"]["loss"])]
    assert diffs and max(diffs) < 2e-2, diffs
    text = path.read_text()
    assert "### What each row sent" in text and "| bf16 (bf16) |" in text
    assert "- AMSP (plan ddp) / DDP: no ratio" not in text
    # CPU per step reaches the row and the report (tiny steps: figures of a few 10 ms ticks)
    for key in systems:
        assert set(by[key]["cpu_s_per_step"]) == {"main", "other"}, key
    assert "### CPU per step beside wall time" in text


@pytest.mark.distributed
@pytest.mark.slow  # four more 4-rank launches, DeepSpeed among them (conftest.py [Note: test tiers])
def test_every_row_sends_the_asked_gradient_bytes_fp32_and_zero1(tmp_path):
    P, _ = _num_params("tiny-llama")
    systems = ["ddp", "ddp-bf16", "hsdp", "amsp-plan"]
    spec, path, by = _compare(tmp_path / "fp32", systems, reduce_dtype="fp32", limit_rounds=1, num_steps=4)
    _check_bytes(spec, by, systems, elem=4)  # ddp-bf16: its hook all-reduces each bf16 bucket in fp32
    # every row against its limit (compare/limit.py): the compute-only job ran on the fake
    # group, the step's collectives were replayed; compute alone is no slower than the step that
    # also communicates, but it is a second job a minute later on a shared host: 10 % of slack
    for key in systems:
        lim, run = by[key]["limit"], by[key]["compute_only_run"]
        assert run["status"] == "ok" and run["backends"] == ["fake"], (key, run)
        assert 0 < lim["compute_only_s"] <= 1.1 * by[key]["median_step_s"], (key, lim, by[key]["median_step_s"])
        assert 0 < lim["last_backward_s"] < lim["compute_only_s"], (key, lim)
        assert lim["comm_only_s"] > 0, (key, lim)
        assert lim["bound_s"] == max(lim["compute_only_s"], lim["comm_only_s"]), (key, lim)
        assert lim["efficiency"] == lim["bound_s"] / by[key]["median_step_s"], (key, lim)
        assert lim["hidden_fraction"] == 1 - by[key]["exposed_comm_s"] / lim["comm_only_s"], (key, lim)
    assert "### Each row against its limit" in path.read_text()
    assert (path.with_suffix("") / "limit.png").exists()
    for reduce_dtype, elem in (("fp32", 4), ("bf16", 2)):
        spec, _, by = _compare(tmp_path / f"z1{reduce_dtype}", ["zero1", "amsp-plan"], reduce_dtype=reduce_dtype,
                               plan="zero1")
        for key in ("zero1", "amsp-plan"):
            row = by[key]
            assert row["status"] == "ok", (key, row.get("reason"))
            # ZeRO-1: every gradient reduced once a step (to its owner or all-reduced); AMSP's
            # all-reduce with a flag per tensor (grad_sync.py [Note: a parameter no backward reached])
            flags = _num_tensors("tiny-llama") if key == "amsp-plan" else 0
            assert row["wire"]["grad_bytes_per_step"] == elem * (P + flags), (key, reduce_dtype, row["wire"])
            assert row["wire"]["grad_dtype"] == reduce_dtype, (key, row["wire"])
