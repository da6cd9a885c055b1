"""The CPU's fused decode step (workers/ops/fused_decode.py) against the layer loop it
replaces, which the HF-oracle tests check: the same kernels in the same order, so the
hidden states and every KV write must be bit-equal; and the steps and weights it must
leave to the loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache.kv_quant import row_width
from kvcache.kv_tensors import KVShape
from workers.loading import load_checkpoint
from workers.models.decoder import DecoderLM
from workers.ops.base import AttentionMetadata, PrefillSegment
from workers.ops.cpu_kernels import CpuOps, load_cpu_kernels
from workers.ops.fused_decode import FusedDecode
from workers.ops.linear_choice import LinearChooser, LinearImpl
from workers.ops.quant_linear import Int8Weight

CPU = torch.device("cpu")
BS = 16
PROMPTS = (5, 19, 33)   # tokens per sequence: within one block, across blocks, past two


@pytest.fixture
def ops(monkeypatch, request) -> CpuOps:
    """CPU ops whose w8a16 layers get ``request.param`` (the chooser's timing on a tiny
    model could pick either)."""
    assert load_cpu_kernels() is None
    offered = CpuOps.linear_candidates
    name = getattr(request, "param", "int8-kernel")

    def candidates(self: CpuOps, weight: torch.Tensor | Int8Weight) -> list[LinearImpl]:
        given = offered(self, weight)
        if isinstance(weight, Int8Weight) and weight.scheme == "w8a16":
            return [c for c in given if c.name == name]
        return given

    monkeypatch.setattr(CpuOps, "linear_candidates", candidates)
    return CpuOps(LinearChooser())   # no store: nothing shared with other tests


def build(tiny_factory, arch: str, ops: CpuOps, quantization: str = "w8a16") -> DecoderLM:
    ck = load_checkpoint(tiny_factory(arch).path)
    return DecoderLM(ck.config, ck.weights, ops, 64, CPU, torch.float32, quantization)


def slots(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table[positions // BS] * BS + positions % BS


def decode_meta(tables: list[torch.Tensor], positions: torch.Tensor) -> AttentionMetadata:
    flat = torch.cat([slots(t, p[None]) for t, p in zip(tables, positions)])
    return AttentionMetadata(flat, len(tables), torch.stack(tables), positions + 1, [], BS)


class Counted:
    """A fused step that counts the steps it ran."""

    def __init__(self, fuse: FusedDecode) -> None:
        self.fuse, self.calls = fuse, 0

    def runs(self, *args: Any) -> bool:
        return self.fuse.runs(*args)

    def __call__(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.fuse(*args)


def run(model: DecoderLM, fused: bool, kv_dtype: torch.dtype
        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three prompts prefilled (always the loop), then a decode step of all three and
    one of the second alone, the decodes fused or not: their hidden states and the pool."""
    cfg = model.cfg
    kv = model.ops.allocate_kv(KVShape(cfg.num_layers, BS, cfg.num_kv_heads,
                                       row_width(cfg.head_dim, kv_dtype), kv_dtype,
                                       model.ops.kv_layout), 12, CPU)
    tables = [torch.arange(4) + 4 * i for i in range(len(PROMPTS))]
    g = torch.Generator().manual_seed(0)
    for n, table in zip(PROMPTS, tables):
        pos = torch.arange(n)
        meta = AttentionMetadata(slots(table, pos), 0, torch.zeros(0, 1, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long),
                                 [PrefillSegment(0, n, n, table)], BS)
        model.forward(torch.randint(3, 256, (n,), generator=g), pos, kv, meta)
    fuse = model.fused_decode
    counted = Counted(fuse)
    model.fused_decode = counted if fused else None
    outs = []
    for rows in ([0, 1, 2], [1]):
        positions = torch.tensor([PROMPTS[r] for r in rows]) + (rows == [1])
        meta = decode_meta([tables[r] for r in rows], positions)
        assert fuse.runs(len(rows), meta, kv_dtype)
        outs.append(model.forward(torch.randint(3, 256, (len(rows),), generator=g),
                                  positions, kv, meta))
    model.fused_decode = fuse
    assert counted.calls == (2 if fused else 0)
    return outs, kv


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("arch", ["llama", "pangu"])   # pangu: q/k/v and o biases
def test_a_fused_decode_step_is_the_layer_loop_bit_for_bit(tiny_factory, ops, arch, kv_dtype):
    model = build(tiny_factory, arch, ops)
    assert model.fused_decode is not None
    fused_out, fused_kv = run(model, True, kv_dtype)
    loop_out, loop_kv = run(model, False, kv_dtype)
    for a, b in zip(fused_out, loop_out):
        assert torch.equal(a, b)
    for a, b in zip(fused_kv, loop_kv):
        assert torch.equal(a, b)


def test_prefills_and_sparse_decodes_keep_the_loop(tiny_factory, ops):
    fuse = build(tiny_factory, "llama", ops).fused_decode
    table = torch.arange(4)
    decode = decode_meta([table], torch.tensor([7]))
    assert fuse.runs(1, decode, torch.float32)
    prefill = AttentionMetadata(slots(table, torch.arange(3)), 0,
                                torch.zeros(0, 1, dtype=torch.long),
                                torch.zeros(0, dtype=torch.long),
                                [PrefillSegment(0, 3, 3, table)], BS)
    mixed = AttentionMetadata(torch.arange(4), 1, table[None], torch.tensor([8]),
                              [PrefillSegment(1, 3, 3, table + 4)], BS)
    sparse = AttentionMetadata(decode.slot_mapping, 1, decode.decode_block_tables,
                               decode.decode_seq_lens, [], BS,
                               decode_head_tables=table.view(1, 1, 4).expand(1, 2, 4),
                               decode_head_lens=torch.tensor([[8, 8]]))
    assert not fuse.runs(3, prefill, torch.float32)
    assert not fuse.runs(4, mixed, torch.float32)
    assert not fuse.runs(1, sparse, torch.float32)
    assert not fuse.runs(1, decode, torch.float64)   # a pool the kernels do not take


@pytest.mark.parametrize("ops", ["dequant"], indirect=True)
def test_other_weights_and_layers_keep_the_loop(tiny_factory, ops):
    """w8a16 layers the chooser gave the dequantizing GEMM, fp32 and w8a8 weights,
    q/k norms (qwen3)."""
    assert build(tiny_factory, "llama", ops).fused_decode is None
    for arch, quantization in (("llama", "none"), ("llama", "w8a8"), ("qwen3", "w8a16")):
        assert build(tiny_factory, arch, CpuOps(LinearChooser()),
                     quantization).fused_decode is None
