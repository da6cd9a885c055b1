"""Kernel choice by measurement: the chooser keeps the faster of candidates whose costs
the test sets (a fake clock, no wall-clock timing), per batch-size range; and every
implementation the CPU ops may choose computes ``x @ W.T + b`` (a float64 oracle)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from tests.workers.test_quant_linear import asymmetric_int8
from workers.loading.checkpoint import cache_root
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels
from workers.ops.linear_choice import (
    CHOICES_ENV,
    ChoiceStore,
    ChosenLinear,
    LinearChooser,
    LinearImpl,
    RowRange,
    default_store,
)
from workers.ops.quant_linear import Int8Weight

RANGES = (RowRange(1, 1), RowRange(4, 8), RowRange(17, 128))


class FakeCosts:
    """Candidates whose calls advance a fake clock by a cost the test chose; every
    pack and run is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.packed: list[str] = []
        self.ran: list[tuple[str, int]] = []

    def clock(self) -> float:
        return self.now

    def impl(self, name: str, cost) -> LinearImpl:
        def pack(w):
            self.packed.append(name)
            return (name, w)

        def run(x, packed, bias):
            assert packed[0] == name
            rows = x.shape[0]
            self.now += cost(rows)
            self.ran.append((name, rows))
            return x @ packed[1].T

        return LinearImpl(name, pack, run)


def test_the_chooser_keeps_the_cheaper_candidate_per_range():
    """``flat`` costs 5 a call, ``per_row`` 1 a row: ``per_row`` wins at 1 row, ``flat``
    at 8 and 128; calls then go to the winner of their row count's range."""
    costs = FakeCosts()
    chooser = LinearChooser(RANGES, clock=costs.clock)
    cands = [costs.impl("flat", lambda rows: 5.0), costs.impl("per_row", float)]
    w = torch.randn(6, 4)
    chosen = chooser.choose(w, "fp32", (6, 4), cands)
    assert chosen.choice.names == ("per_row", "flat", "flat")
    assert chosen.choice.timings_ms[0] == {"flat": 5000.0, "per_row": 1000.0}
    assert "rows 1-3: per_row" in chosen.choice.describe()
    costs.ran.clear()
    for rows, want in ((1, "per_row"), (3, "per_row"), (4, "flat"), (16, "flat"),
                       (17, "flat"), (500, "flat")):
        x = torch.randn(rows, 4)
        torch.testing.assert_close(chosen(x, None), x @ w.T)
        assert costs.ran[-1] == (want, rows)


def test_a_shape_is_timed_once_and_later_weights_pack_only_their_choice():
    costs = FakeCosts()
    chooser = LinearChooser(RANGES, clock=costs.clock)
    cands = [costs.impl("slow", lambda rows: 9.0), costs.impl("fast", lambda rows: 1.0)]
    chooser.choose(torch.randn(6, 4), "fp32", (6, 4), cands)
    assert sorted(costs.packed) == ["fast", "slow"]
    costs.packed.clear()
    costs.ran.clear()
    again = chooser.choose(torch.randn(6, 4), "fp32", (6, 4), cands)
    assert costs.packed == ["fast"] and costs.ran == []
    assert again.choice.names == ("fast",) * 3
    assert list(chooser.choices) == [("fp32", (6, 4))]


def test_processes_of_one_machine_take_the_first_published_choice(tmp_path):
    """Two workers whose timings disagree (load on the machine) still run the same
    implementation: the second takes the first's choice from the store, timing nothing;
    a stored choice naming an unknown candidate is not trusted."""
    store = ChoiceStore(tmp_path, "cpu|2|torch")
    first, second = FakeCosts(), FakeCosts()
    a = LinearChooser(RANGES, clock=first.clock, store=store).choose(
        torch.randn(6, 4), "fp32", (6, 4),
        [first.impl("mkl", lambda rows: 1.0), first.impl("onednn", lambda rows: 2.0)])
    chooser = LinearChooser(RANGES, clock=second.clock, store=store)
    cands = [second.impl("mkl", lambda rows: 2.0), second.impl("onednn", lambda rows: 1.0)]
    b = chooser.choose(torch.randn(6, 4), "fp32", (6, 4), cands)
    assert a.choice.names == b.choice.names == ("mkl",) * 3
    assert second.ran == [] and second.packed == ["mkl"]
    chooser.choose(torch.randn(6, 4), "fp32", (6, 4), cands)   # read once, then remembered
    assert list(chooser.choices) == [("fp32", (6, 4))]
    # Another machine (or torch) keys its own choice.
    other = ChoiceStore(tmp_path, "other cpu|2|torch")
    assert other.get("fp32", (6, 4), RANGES, ["mkl", "onednn"]) is None
    # A choice of candidates this build does not have is measured again.
    path = next(tmp_path.glob("*.json"))
    path.write_text('{"names": ["gone", "gone", "gone"]}')
    third = FakeCosts()
    c = LinearChooser(RANGES, clock=third.clock, store=store).choose(
        torch.randn(6, 4), "fp32", (6, 4),
        [third.impl("mkl", lambda rows: 2.0), third.impl("onednn", lambda rows: 1.0)])
    assert c.choice.names == ("onednn",) * 3 and third.ran


def test_a_call_over_its_budget_is_not_repeated():
    costs = FakeCosts()
    chooser = LinearChooser(RANGES, clock=costs.clock, repeats=3, budget_s=10.0)
    cands = [costs.impl("big", lambda rows: 20.0), costs.impl("small", lambda rows: 2.0)]
    chooser.choose(torch.randn(6, 4), "fp32", (6, 4), cands)
    timed_at_128 = [name for name, rows in costs.ran if rows == 128]
    assert timed_at_128.count("big") == 1 and timed_at_128.count("small") == 3


def test_processes_loading_at_once_time_a_shape_one_at_a_time(tmp_path):
    """A cell's workers load together. While the first times a shape, holding the
    machine's lock, the second waits; then it takes the first's choice, timing nothing
    (timing beside it, each would slow the other's calls)."""
    store = ChoiceStore(tmp_path, "cpu|2|torch")
    first, second = FakeCosts(), FakeCosts()
    timing, release = threading.Event(), threading.Event()

    def held(rows: int) -> float:
        timing.set()
        assert release.wait(60)
        return 1.0

    w = torch.randn(6, 4)
    a = threading.Thread(target=LinearChooser(RANGES, clock=first.clock, store=store).choose,
                         args=(w, "fp32", (6, 4), [first.impl("mkl", held),
                                                   first.impl("onednn", lambda rows: 2.0)]),
                         daemon=True)
    got = []
    b = threading.Thread(target=lambda: got.append(
        LinearChooser(RANGES, clock=second.clock, store=store).choose(
            w, "fp32", (6, 4), [second.impl("mkl", lambda rows: 2.0),
                                second.impl("onednn", lambda rows: 1.0)])), daemon=True)
    a.start()
    try:
        assert timing.wait(60)
        b.start()
        b.join(0.5)
        assert b.is_alive() and not second.ran   # waiting for the lock
    finally:
        release.set()
    a.join(60)
    b.join(60)
    assert got[0].choice.names == ("mkl",) * 3
    assert second.ran == [] and second.packed == ["mkl"]


def test_the_suite_keeps_its_choices_apart_from_the_machines(monkeypatch):
    """Choices timed while other tests load the machine must not stay for the engine's
    later runs there: the suite's processes use a folder of their own."""
    machines = cache_root() / "linear_choice"
    assert default_store("k").directory == Path(os.environ[CHOICES_ENV]) != machines
    monkeypatch.delenv(CHOICES_ENV)
    assert default_store("k").directory == machines


def cpu_ops() -> CpuOps:
    problem = load_cpu_kernels()
    assert problem is None, f"CPU kernels failed to build: {problem}"
    return CpuOps(LinearChooser())   # no store: every shape is timed in this process


@pytest.mark.parametrize("quantization", ["none", "w8a8", "w8a16", "fp16"])
def test_every_candidate_and_the_choice_match_the_oracle(quantization):
    """fp32: ``x @ W.T + b`` in float64; int8 and fp16: the same with the weight as
    stored (dequantized); w8a8 with per-token asymmetric int8 activations, and the w8a16
    kernels with per-row int16 ones (``csrc/packed_linear_cpu.cpp``,
    ``csrc/w8a16_tiles_cpu.cpp``). The choice computes
    what one of them does (to fp32 GEMM rounding: MKL's order of sums may change with
    alignment), and w8a8's two candidates give the same output bit for bit (the same
    exact int32 sums)."""
    ops = cpu_ops()
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(80, 96, generator=g), torch.randn(80, generator=g)
    packed = ops.pack_linear(w, quantization)
    assert isinstance(packed, ChosenLinear)
    if quantization in ("w8a8", "w8a16"):
        weight = Int8Weight.from_int8(quantization, *_int8(w))
        w_eff = weight.qweight.double() * weight.scale.double()[:, None]
    else:
        weight = w.half() if quantization == "fp16" else w
        w_eff = weight.double()
    for rows in (1, 3, 8, 16, 40):
        x = torch.randn(rows, 96, generator=g)
        runs = {c.name: c.run(x, c.pack(weight), b) for c in ops.linear_candidates(weight)}
        for name, got in runs.items():
            x_eff = (_asymmetric_rounded(x) if quantization == "w8a8" else
                     _rounded(x, 32767) if name in ("int8-kernel", "int16-tiles")
                     else x.double())
            want = x_eff @ w_eff.T + b.double()
            assert got.dtype == torch.float32 and got.shape == (rows, 80), name
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")
        chosen = ops.linear(x, packed, b)
        assert any(torch.allclose(chosen, got, rtol=1e-5, atol=1e-5) for got in runs.values())
        if quantization == "w8a8":
            assert torch.equal(runs["int8-mm"], runs["int8-packed"])


def _rounded(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-row symmetric rounding to integers of at most ``qmax``, dequantized."""
    scale = x.abs().amax(dim=1, keepdim=True) / qmax
    return torch.round(x / scale).double() * scale.double()


def _asymmetric_rounded(x: torch.Tensor) -> torch.Tensor:
    """W8A8's per-row asymmetric int8 (``test_quant_linear``'s oracle), dequantized."""
    q, scale = asymmetric_int8(x)
    return q.double() * scale[:, None]


def _int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 by its definition."""
    scale = t.abs().amax(dim=1) / 127
    return torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def test_the_cpu_ops_time_the_fp32_gemms_once_per_shape():
    ops = cpu_ops()
    names = [c.name for c in ops.linear_candidates(torch.randn(4, 4))]
    assert names == ["mkl", "onednn"]
    for _ in range(3):
        ops.pack_linear(torch.randn(40, 48))
    ops.pack_linear(torch.randn(40, 48), "w8a16")
    assert sorted(ops.chooser.choices) == [("fp32", (40, 48)), ("w8a16", (40, 48))]
    choice = ops.chooser.choices[("fp32", (40, 48))]
    assert all(set(ms) == {"mkl", "onednn"} for ms in choice.timings_ms)
