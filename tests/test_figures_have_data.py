"""Every measured figure in the docs has its raw data in a committed JSON (issue 37, part 4).

What counts as a figure (the rule the extractor applies, ``figures()``): outside fenced code
blocks (```) and inline code spans (`...`), a number, a range ``a-b`` or a pair ``a/b``,
directly followed by a measurement unit:
- a ratio: ``x`` attached to the number (``1.21x``; ``2 x 2`` or ``p=1x1`` are shapes, not ratios);
- a percentage: ``%``;
- a time: ``ms``, ``s``, ``min``, ``minutes``;
- a size: ``KiB``, ``MiB``, ``GiB``, ``MB``, ``GB``;
- a throughput: ``tokens/s``, ``tokens/GPU/s``.
Link speeds (``100 Mbit``) are the lab's settings, and numbers without a unit (counts, plan
factors, steps) are left out. Command lines belong in code blocks and are skipped with them.

Every figure of DOCS must be accounted for, per document, by exactly one of:
- ``SOURCES``: the committed JSON under comparisons/results/ that holds it, and a function that
  reads from that JSON (by key, not by searching for the number) the values the figure states,
  in the figure's unit. Each number as written must equal one of those values rounded to the
  decimals written (both ends of a range). ``bound=True`` marks a "within N" figure: every value,
  rounded the same way, must be at most N.
- ``NOT_MEASURED``: the reason the figure is not a measurement (a default or a flag's value, a
  threshold in the code, a budget, the paper's or a table's setting, a planner price that a
  stated command reproduces).
An entry that no figure of its document uses any more fails as well, so the tables cannot rot.
The self-checks at the end feed crafted lines through the same functions and require them to fail.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "comparisons" / "results"
DOCS = ("README.md", "comparisons/README.md", "docs/usage.md", "docs/planner.md", "docs/DESIGN.md")

_NUM = r"\d[\d,]*(?:\.\d+)?"
_UNIT = (r"x(?![\w=])"
         r"|\s?%"
         r"|\s?(?:tokens/GPU/s|tokens/s|minutes|min|ms|s|KiB|MiB|GiB|MB|GB)(?![\w/])")
_FIGURE = re.compile(rf"(?<![\w.,/=-])(?:(?<=[\s(|])[+-])?{_NUM}(?:\s?[-–/]\s?{_NUM})*(?:{_UNIT})")


@dataclass(frozen=True)
class Figure:
    text: str  # as found, whitespace removed and dashes normalised: "0.175-0.244s"
    numbers: tuple[float, ...]
    decimals: tuple[int, ...]
    line: int
    source_line: str


def _normal(text: str) -> str:
    return re.sub(r"\s+", "", text.replace("–", "-"))


def figures(markdown: str) -> list[Figure]:
    """The figures of a Markdown text by the rule in the module docstring."""
    lines, fenced = markdown.splitlines(), False
    prose = []
    for line in lines:
        fence = line.lstrip().startswith("```")
        prose.append("" if fenced or fence else line)
        fenced ^= fence
    # a code span may wrap over a line break: blank it in the whole text, keeping the lines
    text = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), "\n".join(prose))
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        for m in _FIGURE.finditer(line):
            found = _normal(m.group(0))
            sign = -1.0 if found.startswith("-") else 1.0
            parts = re.findall(_NUM, found)
            nums = tuple((sign if i == 0 else 1.0) * float(p.replace(",", "")) for i, p in enumerate(parts))
            decs = tuple(len(p.split(".")[1]) if "." in p else 0 for p in parts)
            out.append(Figure(found, nums, decs, number, lines[number - 1]))
    return out


def load(rel: str) -> Any:
    return json.loads((RESULTS / rel).read_text())


@dataclass(frozen=True)
class Source:
    doc: str
    figure: str  # Figure.text
    json: str  # relative to comparisons/results/
    values: Callable[[Any], Iterable[float]]
    bound: bool = False


def check_source(fig: Figure, src: Source, data: Any) -> str | None:
    """None if the figure's numbers are the JSON's values as written, else why not."""
    values = [float(v) for v in src.values(data)]
    if not values or any(math.isnan(v) for v in values):
        return f"{src.json}: no values for {fig.text!r}"
    for num, dec in zip(fig.numbers, fig.decimals):
        rounded = [round(v, dec) for v in values]
        if src.bound:
            if max(abs(r) for r in rounded) > num + 1e-9:
                return f"{fig.text!r}: a value in {src.json} exceeds {num} ({max(values, key=abs)})"
        elif not any(abs(r - num) < 1e-9 for r in rounded):
            return f"{fig.text!r}: {num} is not in {src.json} (values {[round(v, 4) for v in values][:8]})"
    return None


def unaccounted(doc: str, found: list[Figure], sources: list[Source], exempt: dict) -> list[str]:
    """Figures of ``doc`` that neither a source nor an exemption covers, and stale entries."""
    covered = {s.figure for s in sources if s.doc == doc} | {f for (d, f) in exempt if d == doc}
    texts = {f.text for f in found}
    missing = [f"{doc}:{f.line}: {f.text!r} has no JSON source ({f.source_line.strip()[:90]})"
               for f in found if f.text not in covered]
    stale = [f"{doc}: entry {t!r} matches no figure" for t in sorted(covered - texts)]
    return missing + stale


# -- reading the JSON ---------------------------------------------------------------------------

def _row(result: dict, system: str) -> dict:
    return next(r for r in result["rows"] if r["system"] == system)


def _ratio(result: dict, numerator: str, denominator: str) -> dict:
    return next(r for r in result["ratios"] if r["numerator"] == numerator and r["denominator"] == denominator)


def _ratio_values(numerator: str, denominator: str) -> Callable[[dict], list[float]]:
    return lambda d: [_ratio(d, numerator, denominator)[k] for k in ("median", "min", "max")]


MiB, GiB = 2 ** 20, 2 ** 30
_GPU = "gpu_h200_2026-12-04/gpu_check.json"
_FROZEN_7B = "dryrun_7b_policy_reference_2026-12-07/policy_and_reference.json"
_GENERATION = "generation_gather_lab-100mbit_2026-12-07/small-llama.json"
_PLANS = ("auto", "zero3", "mics:8")


def _alloc_over_count_pct(d: dict) -> list[float]:
    # allocated peak minus MemTracker's count minus the fp32 masters MemTracker left out
    s = d["scale"]
    return [100 * (s[p]["real"]["peak_allocated_bytes"] - s[p]["memtracker_peak_bytes"]
                   - s[p]["model_state_bytes"]["master"]) / s[p]["real"]["peak_allocated_bytes"]
            for p in _PLANS]


def _planner_vs_alloc_pct(plans: tuple[str, ...]) -> Callable[[dict], list[float]]:
    return lambda d: [100 * (d["scale"][p]["planner"]["total"] - d["scale"][p]["real"]["peak_allocated_bytes"])
                      / d["scale"][p]["real"]["peak_allocated_bytes"] for p in plans]


def _reserved_over_alloc_gib(d: dict) -> list[float]:
    return [(d["scale"][p]["real"]["peak_reserved_bytes"] - d["scale"][p]["real"]["peak_allocated_bytes"]) / GiB
            for p in _PLANS]


def _moment_category_dev_pct(d: dict) -> list[float]:
    # engine / planner per category at the engine's peak moment, gradients excepted (docs/planner.md)
    out = []
    for run in d.values():
        rank, plan = run["ranks"][0], run["planner"]
        moment = plan["moments"][rank["peak_moment"]]
        planned = {"params": plan["memory"]["params"], "optimizer": plan["memory"]["optimizer"],
                   "activations": moment["activations"], "temporary": moment["temporary"]}
        out += [100 * (rank["memory"][k] / v - 1) for k, v in planned.items() if v]
    return out


def _dryrun_7b_minutes(d: dict) -> list[float]:
    return [run["ranks"][0]["wall_s"] / 60 for name, run in d.items() if name.startswith("7b_")]


_RES = "resilience_checkpoint.json"
SOURCES: list[Source] = [
    # README.md
    Source("README.md", "1.17x", "small-llama_cpu-2x2-lab-100mbit_2026-12-05_fp32_replicate_ddp/results.json",
           _ratio_values("amsp-plan", "ddp")),
    Source("README.md", "1.14-1.20x", "small-llama_cpu-2x2-lab-100mbit_2026-12-05_fp32_replicate_ddp/results.json",
           _ratio_values("amsp-plan", "ddp")),
    # comparisons/README.md
    Source("comparisons/README.md", "1.25x", "small-llama_cpu-2x2-lab-100mbit_2026-12-05_fp32_deepspeed_hsdp/results.json",
           _ratio_values("amsp-mics", "mics")),
    Source("comparisons/README.md", "1.23-1.28x",
           "small-llama_cpu-2x2-lab-100mbit_2026-12-05_fp32_deepspeed_hsdp/results.json",
           _ratio_values("amsp-mics", "mics")),
    Source("comparisons/README.md", "1.37x", "small-llama_cpu-2x2-lab-1gbit_2026-12-05_fp32/results.json",
           _ratio_values("amsp-mics", "mics")),
    Source("comparisons/README.md", "1.34-1.79x", "small-llama_cpu-2x2-lab-1gbit_2026-12-05_fp32/results.json",
           _ratio_values("amsp-mics", "mics")),
    Source("comparisons/README.md", "920MiB", "small-llama_cpu-2x2-lab-1gbit_2026-12-03_current/results.json",
           lambda d: [max(_row(d, "ddp")["peak_rss_delta_bytes"]) / MiB]),
    Source("comparisons/README.md", "1837MiB",
           "small-llama_cpu-2x2-lab-1gbit_2026-12-03_all_reduce_auto_trace3/results.json",
           lambda d: [max(_row(d, "ddp")["peak_rss_delta_bytes"]) / MiB]),
    Source("comparisons/README.md", "37MB", _RES, lambda d: [d["checkpoint_bytes"] / 1e6]),
    Source("comparisons/README.md", "0.207s", _RES, lambda d: [d["sync"]["stall"]["median_s"]]),
    Source("comparisons/README.md", "0.175-0.244s", _RES,
           lambda d: [d["sync"]["stall"]["min_s"], d["sync"]["stall"]["max_s"]]),
    Source("comparisons/README.md", "0.111s", _RES, lambda d: [d["async"]["stall"]["median_s"]]),
    Source("comparisons/README.md", "0.051-0.186s", _RES,
           lambda d: [d["async"]["stall"]["min_s"], d["async"]["stall"]["max_s"]]),
    Source("comparisons/README.md", "1.00s", _RES, lambda d: [d["async"]["published"]["median_s"]]),
    Source("comparisons/README.md", "0.92-1.24s", _RES,
           lambda d: [d["async"]["published"]["min_s"], d["async"]["published"]["max_s"]]),
    Source("comparisons/README.md", "0.836s", _RES, lambda d: [d["async"]["step_during_write"]["median_s"]]),
    Source("comparisons/README.md", "0.654s", _RES, lambda d: [d["async"]["plain_step"]["median_s"]]),
    Source("comparisons/README.md", "0.635s", "resilience_guard_small-llama.json",
           lambda d: [d["guard_on"]["median_s"]]),
    Source("comparisons/README.md", "0.655s", "resilience_guard_small-llama.json",
           lambda d: [d["guard_off"]["median_s"]]),
    Source("comparisons/README.md", "-3%", "resilience_guard_small-llama.json",
           lambda d: [100 * d["overhead_median"]]),
    Source("comparisons/README.md", "0.172s", "resilience_guard_tiny-llama.json",
           lambda d: [d["guard_on"]["median_s"]]),
    Source("comparisons/README.md", "0.170s", "resilience_guard_tiny-llama.json",
           lambda d: [d["guard_off"]["median_s"]]),
    Source("comparisons/README.md", "+0.7%", "resilience_guard_tiny-llama.json",
           lambda d: [100 * d["overhead_median"]]),
    Source("comparisons/README.md", "0.3-0.4%", _GPU, _alloc_over_count_pct),
    Source("comparisons/README.md", "0.5%", _GPU, _planner_vs_alloc_pct(("auto", "zero3")), bound=True),
    Source("comparisons/README.md", "3-9GiB", _GPU, _reserved_over_alloc_gib),
    Source("comparisons/README.md", "0.67s", "gpu_h200_2026-12-04/scale_fsdp2_vs_amsp_run3.json",
           lambda d: [d["amsp:zero3"]["step_s"]]),
    Source("comparisons/README.md", "0.64s", "gpu_h200_2026-12-04/scale_fsdp2_vs_amsp_run3.json",
           lambda d: [d["fsdp2:zero3"]["step_s"]]),
    Source("comparisons/README.md", "1.01x", "gpu_h200_2026-12-04/engine_large_run4.json",
           lambda d: [d["engine_large"]["amsp_ddp_bf16"]["median_step_s"]
                      / d["engine_large"]["plain_autocast"]["median_step_s"]]),
    # docs/usage.md
    Source("docs/usage.md", "1.0-3.7%", "adaptive_small-llama_cpu-2x2-lab_2026-12-01.json",
           lambda d: [100 * run["analysis"]["a"]["after_switch_vs_c"] for run in d]),
    Source("docs/usage.md", "33%", "adaptive_small-llama_cpu-2x2-lab_2026-12-01.json",
           lambda d: [100 * run["analysis"]["b"]["slowdown_vs_c"] for run in d]),
    Source("docs/usage.md", "71.52GiB", _FROZEN_7B, lambda d: [d["ranks"][0]["peak_bytes"] / 2**30]),
    Source("docs/usage.md", "71.42GiB", _FROZEN_7B, lambda d: [d["planner"]["memory"]["total"] / 2**30]),
    Source("docs/usage.md", "12.55GiB", _FROZEN_7B,
           lambda d: [(d["ranks"][0]["memory"]["params"] - d["ranks"][0]["model_state_bytes"]["params"]) / 2**30]),
    Source("docs/usage.md", "794ms", _GENERATION, lambda d: [1e3 * d["summary"]["per_layer"]["median_s_per_token"]]),
    Source("docs/usage.md", "30ms", _GENERATION, lambda d: [1e3 * d["summary"]["gather_once"]["median_s_per_token"]]),
    # docs/planner.md
    Source("docs/planner.md", "5%", "dryrun_paper-a800_2026-12-02_moments.json", _moment_category_dev_pct,
           bound=True),
    Source("docs/planner.md", "0.5%", _GPU, _planner_vs_alloc_pct(("auto", "zero3")), bound=True),
    Source("docs/planner.md", "8.5%", _GPU, _planner_vs_alloc_pct(("mics:8",))),
    Source("docs/planner.md", "3-9GiB", _GPU, _reserved_over_alloc_gib),
    Source("docs/planner.md", "2-4minutes", "dryrun_paper-a800_2026-12-02_moments.json", _dryrun_7b_minutes),
]

NOT_MEASURED: dict[tuple[str, str], str] = {
    ("README.md", "15minutes"): "the default tier's budget, a target",
    ("README.md", "25MiB"): "grad_bucket_bytes' default",
    ("README.md", "600s"): "the timeout's default",
    ("comparisons/README.md", "5%"): "the removed ownership policy's threshold in the code",
    ("comparisons/README.md", "0.1%"): "arithmetic on the block sizes the same line states",
    ("comparisons/README.md", "1min"): "the load average's window",
    ("comparisons/README.md", "1.0x"): "the claim rule's threshold (compare/rounds.py)",
    ("comparisons/README.md", "80%"): "the claim rule's share of agreeing rounds (compare/rounds.py)",
    ("docs/usage.md", "1.5x"): "the CPU bf16 check's threshold in the code",
    ("docs/usage.md", "5%"): "the report's gradient-bytes tolerance (compare/wire.py)",
    ("docs/usage.md", "1.0x"): "the claim rule's threshold (compare/rounds.py)",
    ("docs/usage.md", "80%"): "the claim rule's share of agreeing rounds (compare/rounds.py)",
    ("docs/planner.md", "64MiB"): "the paper's allgather anchor size",
    ("docs/planner.md", "1MiB"): "the profile table's smallest size",
    ("docs/planner.md", "1GiB"): "the profile table's largest size",
    ("docs/planner.md", "2GiB"): "the memory reserve's default",
    ("docs/planner.md", "7%"): "a planner price (Eq. 1), not a measurement; design_history.md gives its command",
    ("docs/planner.md", "100%"): "MFU's upper limit, a rule",
    ("docs/planner.md", "1%"): "the tie tolerance's default",
    ("docs/planner.md", "80GiB"): "the paper's GPU memory, a setting",
    ("docs/planner.md", "55GiB"): "planner output for Table IV (tests/test_planner_table_iv.py)",
    ("docs/planner.md", "+0.8%"): "planner output for Table IV (tests/test_planner_table_iv.py)",
    ("docs/planner.md", "+40%"): "planner output for Table IV (tests/test_planner_table_iv.py)",
    ("docs/planner.md", "+3.8%"): "planner output for Table IV (tests/test_planner_table_iv.py)",
    ("docs/planner.md", "+62%"): "planner output for Table IV (tests/test_planner_table_iv.py)",
    ("docs/planner.md", "+1.0%"): "planner output for Table IV (tests/test_planner_table_iv.py)",
    ("docs/DESIGN.md", "6s"): "the launcher's SIGKILL grace period in the code",
    ("docs/DESIGN.md", "15minutes"): "the default tier's budget, a target",
}


@pytest.mark.parametrize("doc", DOCS)
def test_every_figure_is_sourced_or_not_a_measurement(doc):
    problems = unaccounted(doc, figures((ROOT / doc).read_text()), SOURCES, NOT_MEASURED)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("src", SOURCES, ids=lambda s: f"{s.doc}:{s.figure}")
def test_source_json_holds_the_figure(src):
    path = RESULTS / src.json
    assert path.is_file(), f"{src.json} is not under comparisons/results/"
    found = [f for f in figures((ROOT / src.doc).read_text()) if f.text == src.figure]
    assert found, f"{src.doc}: no figure {src.figure!r}"
    data = load(src.json)
    problems = [p for f in found if (p := check_source(f, src, data))]
    assert not problems, "\n".join(problems)


def claim_rule_problem(src: Source, data: Any) -> str | None:
    """A quoted ratio of a comparison run (its JSON has ``meta.spec``) must come from a run the
    claim rule accepts (compare/rounds.py [Note: what a claim needs]): >= 10 timed steps per
    job and >= 5 rounds; and no ratio the report refused may carry a claim."""
    if not src.figure.endswith("x") or not isinstance(data, dict) or "spec" not in data.get("meta", {}):
        return None
    from amsp_ext.compare.rounds import CLAIM_MIN_ROUNDS, CLAIM_MIN_TIMED_STEPS

    spec, rounds = data["meta"]["spec"], data["meta"].get("repeats") or 1
    timed = spec["num_steps"] - spec.get("num_warmup_steps", 0)
    if timed < CLAIM_MIN_TIMED_STEPS or rounds < CLAIM_MIN_ROUNDS:
        return (f"{src.doc}: {src.figure!r} comes from {src.json}: {timed} timed steps x {rounds} rounds, "
                f"the claim rule asks >= {CLAIM_MIN_TIMED_STEPS} x >= {CLAIM_MIN_ROUNDS}")
    return None


@pytest.mark.parametrize("src", [s for s in SOURCES if s.figure.endswith("x")], ids=lambda s: f"{s.doc}:{s.figure}")
def test_a_quoted_ratio_meets_the_claim_rule(src):
    assert claim_rule_problem(src, load(src.json)) is None


def test_no_refused_ratio_carries_a_claim():
    bad = []
    for path in sorted(RESULTS.glob("**/*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            continue
        for r in (data.get("ratios") or []) if isinstance(data, dict) else []:
            if r.get("refused") and (r.get("verdict") or {}).get("claim"):
                bad.append(f"{path.relative_to(RESULTS)}: {r['numerator']} / {r['denominator']}")
    assert not bad, bad


def test_a_ratio_from_a_short_run_fails_the_claim_rule():
    src = Source("README.md", "2.45x", "tiny-llama_cpu-2x2-lab_2026-11-30_dissociation_repeats6/results.json",
                 _ratio_values("amsp-mics", "mics"))
    problem = claim_rule_problem(src, load(src.json))  # 6 rounds of too few timed steps
    assert problem is not None and "the claim rule asks >= 10 x >= 5" in problem, problem


def test_source_json_is_committed():
    """The JSON must be in git, not just on this disk (skipped outside a git checkout)."""
    import subprocess
    try:
        tracked = subprocess.run(["git", "ls-files", "comparisons/results"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    if not tracked:
        pytest.skip("not a git checkout")
    missing = sorted({s.json for s in SOURCES} - {p.removeprefix("comparisons/results/") for p in tracked})
    assert not missing, f"not committed: {missing}"


# -- self-checks: the rule and the checks can fail ---------------------------------------------

def test_extractor_rule():
    text = "\n".join([
        "AMSP ran 2.45x DDP and 1.04-1.30x over rounds; 3–9 GiB; 0.60/0.67 s; -3 % (noise)",
        "a 2 x 2 lab, plan p=1x1,g=2x1, `--gpu-memory 80GiB`, `--bucket\n1MiB`, 100 Mbit, 20 steps",
        "```",
        "amsp compare --quick   # 4 ranks, a few minutes, 20 s",
        "```",
    ])
    assert [f.text for f in figures(text)] == ["2.45x", "1.04-1.30x", "3-9GiB", "0.60/0.67s", "-3%"]
    assert figures(text)[4].numbers == (-3.0,)


def test_an_unsourced_figure_fails():
    crafted = "The engine ran 9.99x faster than DDP (no JSON anywhere)."
    problems = unaccounted("README.md", figures(crafted), SOURCES, NOT_MEASURED)
    assert any("9.99x" in p for p in problems)


def test_a_figure_the_json_does_not_hold_fails():
    src = next(s for s in SOURCES if s.figure == "1.17x")
    data = load(src.json)
    (right,) = figures("ran 1.17x DDP")
    (wrong,) = figures("ran 1.25x DDP")
    assert check_source(right, src, data) is None
    assert check_source(wrong, src, data) is not None
    bound = Source("x", "0.1%", _GPU, _planner_vs_alloc_pct(("auto", "zero3")), bound=True)
    assert check_source(figures("within 0.1 %")[0], bound, load(_GPU)) is not None


def test_a_stale_entry_fails():
    gone = [Source("README.md", "7.77x", "resilience_checkpoint.json", lambda d: [7.77])]
    assert any("7.77x" in p and "matches no figure" in p for p in unaccounted("README.md", [], gone, {}))


def test_medians_of_rounds_are_what_the_ratio_records():
    # the ratio entries above trust ratios[].median; check it is the median of its own rounds
    d = load("small-llama_cpu-2x2-lab-100mbit_2026-12-03_replicate_two_level/results.json")
    r = _ratio(d, "amsp-plan", "ddp")
    assert r["median"] == pytest.approx(median(r["per_round"]))
