"""Issue 22 item 1: on a CPU without native bf16 the bf16 default becomes fp32 (one line, before
the run) and an explicit bf16 warns with the measured slowdown."""

from __future__ import annotations

import pytest

from amsp_ext.cli import precision as P
from amsp_ext.runtime.measure import cpu_bf16


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(P, "_on_gpu", lambda: False)
    cpu_bf16.probe_cpu_bf16.cache_clear()
    yield monkeypatch
    cpu_bf16.probe_cpu_bf16.cache_clear()


def test_default_bf16_becomes_fp32_on_a_slow_cpu(cpu):
    cpu.setenv(cpu_bf16.FORCE_ENV, "slow")
    lines: list[str] = []
    assert P.cpu_precision(None, "bf16", say=lines.append) == "fp32"
    assert len(lines) == 1 and lines[0].startswith("precision: fp32") and "10.0x" in lines[0]
    lines.clear()
    assert P.cpu_precision("bf16", "bf16", say=lines.append) == "bf16"  # asked for: kept, warned
    assert len(lines) == 1 and lines[0].startswith("warning:") and "10x slower" in lines[0]
    lines.clear()
    assert P.cpu_precision("fp32", "bf16", say=lines.append) == "fp32" and lines == []


def test_a_decided_precision_is_kept_and_bf16_warned_on_a_slow_cpu(cpu):
    """What amsp train / amsp tune call: the engine config's precision is never changed."""
    lines: list[str] = []
    cpu.setenv(cpu_bf16.FORCE_ENV, "slow")
    P.warn_if_slow_bf16("fp32", say=lines.append)
    assert lines == []
    P.warn_if_slow_bf16("bf16", say=lines.append)
    assert len(lines) == 1 and lines[0].startswith("warning: --precision bf16") and "10x slower" in lines[0]
    cpu_bf16.probe_cpu_bf16.cache_clear()
    cpu.setenv(cpu_bf16.FORCE_ENV, "fast")
    lines.clear()
    P.warn_if_slow_bf16("bf16", say=lines.append)
    assert lines == []


def test_fast_cpu_keeps_bf16_silently(cpu):
    cpu.setenv(cpu_bf16.FORCE_ENV, "fast")
    lines: list[str] = []
    assert P.cpu_precision(None, "bf16", say=lines.append) == "bf16" and lines == []


def test_probe_needs_flags_and_timing(cpu):
    cpu.delenv(cpu_bf16.FORCE_ENV, raising=False)
    cpu.setattr(cpu_bf16, "_time_matmul", lambda dtype: 0.674 if str(dtype) == "torch.bfloat16" else 0.062)
    cpu.setattr(cpu_bf16, "_flags", lambda: ("avx512_bf16",))
    slow = cpu_bf16.probe_cpu_bf16()  # flags present, yet 10.9x slower (issue 22's figures)
    assert not slow.fast and slow.slowdown == pytest.approx(0.674 / 0.062)
    cpu_bf16.probe_cpu_bf16.cache_clear()
    cpu.setattr(cpu_bf16, "_time_matmul", lambda dtype: 0.05)
    cpu.setattr(cpu_bf16, "_flags", lambda: ())
    assert not cpu_bf16.probe_cpu_bf16().fast  # no flag: emulated, whatever one timing said
    cpu_bf16.probe_cpu_bf16.cache_clear()
    cpu.setattr(cpu_bf16, "_flags", lambda: ("amx_bf16",))
    assert cpu_bf16.probe_cpu_bf16().fast
