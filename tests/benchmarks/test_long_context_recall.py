"""The recall benchmark's computation on a tiny random model: what must hold of the masses
whatever the model (the oracle bounds every choice of k blocks, all blocks capture all)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.long_context_recall import capture, figures, recall
from kvcache.long_context import SUMMARY_KINDS, LongContextConfig
from workers.loading import load_checkpoint

BLOCK_SIZE = 16
TOKENS = 480
POSITIONS = list(range(300, TOKENS, 20))
TOL = 1e-6


def _config(top_k_percent: float) -> LongContextConfig:
    return LongContextConfig(enabled=True, initial_tokens=16, local_tokens=64,
                             retrieval_block_size=32, top_k_percent=top_k_percent,
                             dense_boundary=POSITIONS[0] + 1)


@pytest.fixture(scope="module")
def tiny_capture(tiny_factory):
    checkpoint = load_checkpoint(tiny_factory("llama").path)
    ids = torch.randint(3, checkpoint.config.vocab_size, (TOKENS,),
                        generator=torch.Generator().manual_seed(0))
    return checkpoint.config, capture(checkpoint, ids.tolist(), POSITIONS, BLOCK_SIZE)


def test_capture_records_every_layer(tiny_capture):
    cfg, cap = tiny_capture
    assert cap.queries.shape == (cfg.num_layers, len(POSITIONS), cfg.num_heads, cfg.head_dim)
    assert cap.keys.shape == (cfg.num_layers, TOKENS, cfg.num_kv_heads, cfg.head_dim)
    assert cap.scale == pytest.approx(cfg.head_dim ** -0.5)


def test_oracle_bounds_every_choice(tiny_capture):
    cfg, cap = tiny_capture
    masses = recall(cap, _config(0.2), SUMMARY_KINDS, BLOCK_SIZE)
    assert set(masses) == {"init+local", "oracle", "random"} | {
        f"selected/{kind}" for kind in SUMMARY_KINDS}
    base, oracle = masses["init+local"], masses["oracle"]
    for name, mass in masses.items():
        assert mass.shape == (len(POSITIONS), cfg.num_layers, cfg.num_kv_heads), name
        assert ((mass >= 0) & (mass <= 1 + TOL)).all(), name
        assert (mass <= oracle + TOL).all(), name
        assert (base <= mass + TOL).all(), name
    assert (oracle > base + 1e-3).any()  # the middle holds mass: the bounds are not vacuous
    figs = figures(masses)
    assert figs["oracle"]["of_oracle_min"] == pytest.approx(1.0)
    assert figs["init+local"]["of_oracle_mean"] < 1.0


def test_all_blocks_capture_all_mass(tiny_capture):
    _, cap = tiny_capture
    masses = recall(cap, _config(1.0), SUMMARY_KINDS, BLOCK_SIZE)
    for name, mass in masses.items():
        if name != "init+local":
            torch.testing.assert_close(mass, torch.ones_like(mass), atol=1e-5, rtol=0)
    assert (masses["init+local"] < 1 - 1e-3).all()
