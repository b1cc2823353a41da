"""``amsp plan``: the JSON contract, exit status, and one-line errors for bad input."""

import copy
import json

import pytest

from amsp_ext.cli.main import main

BASE = ["plan", "--model", "llama-7b", "--nodes", "16", "--gpus-per-node", "8",
        "--gpu-memory", "80GiB", "--profile", "paper-a800", "--seq-len", "4096",
        "--micro-batch-size", "1", "--global-batch-tokens", "4194304"]


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def with_flag(flag, value):
    argv = list(BASE)
    i = argv.index(flag)
    argv[i + 1] = value
    return argv


def test_json_contract(capsys):
    rc, out, err = run(capsys, BASE + ["--json", "--pareto", "--sensitivity", "0.2"])
    assert rc == 0 and err == ""
    d = json.loads(out)
    assert set(d["plan"]) == {"s0_p", "s1_p", "s0_g", "s1_g", "s0_os", "s1_os", "tensor_parallel"}
    assert d["plan"]["tensor_parallel"] == 1 and d["t_comm_s"]["t_tp"] == 0.0
    assert set(d["t_comm_s"]) == {"total", "t_p", "t_g", "t0_os", "t1_os", "t_tp", "t_wt", "t_frozen"}
    t = d["t_comm_s"]
    assert t["total"] == pytest.approx(t["t_p"] + t["t_g"] + t["t0_os"] + t["t1_os"])
    mem = d["memory_bytes"]
    assert {"params", "grads", "optim", "activations", "tmp", "total"} <= set(mem)
    assert mem["total"] == mem["params"] + mem["grads"] + mem["optim"] + mem["activations"] + mem["tmp"]
    assert mem["total"] <= mem["limit"] == 78 * 2**30 and mem["reserve"] == 2 * 2**30
    assert d["feasible"] is True
    assert d["num_micro_batches"] == 8  # 1024 sequences / 128 GPUs
    assert d["candidates"][0]["plan"] == d["plan_text"] and d["candidates"][0]["rank"] == 1
    assert any(not c["feasible"] and c["reason"].startswith("out of memory by") for c in d["candidates"])
    names = [b["name"] for b in d["baselines"]]
    assert names == ["ddp", "zero1", "zero2", "zero3", "zero++", "mics"]
    z3 = d["baselines"][3]
    assert z3["comparison"].startswith("vs ZeRO-3: ")
    assert "communication" in z3["comparison"] and "GiB" in z3["comparison"]
    assert 0 < d["step"]["mfu"] < 1 and d["step"]["tokens_per_gpu_per_s"] > 0
    assert d["pareto"] and "stable" in d["sensitivity"] and len(d["sensitivity"]["cases"]) == 8


def test_text_output(capsys):
    rc, out, _ = run(capsys, BASE + ["--objective", "step"])
    assert rc == 0
    assert "plan     p=" in out and "baselines" in out and "the chosen plan, against this baseline" in out


def test_model_config_path(tmp_path, capsys):
    from amsp_ext.common.models import llama_config_dict

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama_config_dict("tiny-llama")))
    argv = ["plan", "--model-config", str(cfg), "--nodes", "2", "--gpus-per-node", "2",
            "--gpu-memory", "8GiB", "--seq-len", "64", "--global-batch-size", "8",
            "--profile", "paper-a800", "--missing-mesh", "fit", "--json"]
    rc, out, _ = run(capsys, argv)
    assert rc == 0 and json.loads(out)["inputs"]["model"]["num_params"] == 125248


def partial_profile(tmp_path):
    from amsp_ext.planner.profile import PROFILE_DIR

    doc = json.loads((PROFILE_DIR / "paper-a800.json").read_text())
    doc["entries"] = [e for e in doc["entries"] if not (e["op"] == "allreduce" and e["p0"] == 8
                                                        and e["p1"] == 16)]
    p = tmp_path / "partial.json"
    p.write_text(json.dumps(doc))
    return str(p)


def malformed_profile(tmp_path):
    from amsp_ext.planner.profile import PROFILE_DIR

    doc = json.loads((PROFILE_DIR / "paper-a800.json").read_text())
    doc = copy.deepcopy(doc)
    doc["entries"][5]["points"][2]["GBps"] = "fast"
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    return str(p)


@pytest.mark.parametrize("case,match", [
    ("unknown_model", "model must be one of llama-7b, llama-13b, llama-30b, llama-65b"),
    ("non_divisible_world", r"global_batch_tokens=4194304 \(1024 sequences\) must be a multiple of"),
    ("malformed_profile", r"entries\[5\].points\[2\].GBps must be a positive number"),
    ("partial_profile", "has no allreduce entry for mesh 8x16"),
    ("negative_nodes", "--nodes must be an integer >= 1, got -2"),
    ("negative_seq", "--seq-len must be an integer >= 1, got -5"),
    ("memory_no_unit", "--gpu-memory needs a number and a unit"),
    ("negative_memory", "--gpu-memory must be positive"),
    ("bucket_no_unit", "--grad-bucket-bytes: unknown unit"),
    ("reserve_too_big", "memory reserve must be >= 0 and below the GPU memory"),
    ("nothing_fits", r"no plan fits in 2.0 GiB per GPU \(4.0 GiB less a 2.0 GiB reserve\)"),
    ("unknown_profile", "profile must be a bundled name"),
])
def test_bad_input_one_line_error(case, match, capsys, tmp_path):
    argv = {
        "unknown_model": lambda: with_flag("--model", "llama-3b"),
        "non_divisible_world": lambda: with_flag("--nodes", "3"),
        "malformed_profile": lambda: with_flag("--profile", malformed_profile(tmp_path)),
        "partial_profile": lambda: with_flag("--profile", partial_profile(tmp_path)),
        "negative_nodes": lambda: with_flag("--nodes", "-2"),
        "negative_seq": lambda: with_flag("--seq-len", "-5"),
        "memory_no_unit": lambda: with_flag("--gpu-memory", "80"),
        "negative_memory": lambda: [a for a in BASE if a not in ("--gpu-memory", "80GiB")]
        + ["--gpu-memory=-80GiB"],
        "bucket_no_unit": lambda: BASE + ["--grad-bucket-bytes", "128XB"],
        "reserve_too_big": lambda: BASE + ["--memory-reserve", "90GiB"],
        "nothing_fits": lambda: with_flag("--gpu-memory", "4GiB"),
        "unknown_profile": lambda: with_flag("--profile", "paper-h100"),
    }[case]()
    rc, out, err = run(capsys, argv)
    assert rc != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("amsp plan: error: "), err
    assert __import__("re").search(match, err), err


def test_planner_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys; from amsp_ext.cli.main import main; "
            "import amsp_ext.planner.report, amsp_ext.planner.profiles.build_paper_a800; "
            "rc = main(['plan', '--model', 'llama-7b', '--nodes', '2', '--gpus-per-node', '8', "
            "'--gpu-memory', '80GiB', '--seq-len', '4096', '--global-batch-size', '16']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("flag,size,words", [
    ("--mics-size", "3", "group size 3 must divide gpus_per_node=8"),
    ("--hpz-size", "24", "group size 24 must be a multiple of gpus_per_node=8"),
])
def test_a_group_size_that_does_not_fit_names_its_flag_and_the_allowed_sizes(capsys, flag, size, words):
    rc, out, err = run(capsys, BASE + [flag, size])
    assert rc == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and "mics:K" not in line
    assert line.startswith(f"amsp plan: error: {flag}: {words}")
    assert line.endswith("; allowed: 1, 2, 4, 8, 16, 32, 64, 128")
