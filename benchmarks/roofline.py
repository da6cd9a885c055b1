"""The physical limit of a run: its model's linear layers alone, at the batch sizes it ran.

On a CPU in fp32 a small decoder's step is dominated by its four matmuls per layer and
the LM head, so the time those take by themselves on the same weights (packed as the
engine packs them), thread count and row counts is the best a step could do (the
machine's fp32 roofline as it really performs). Each size is timed once on a grid
(powers of two up to the largest seen, plus that largest) and steps in between are
interpolated linearly, so a run of thousands of steps costs a few dozen timings.

    grid = measure_grid(lambda n: linear_layers_time(model, n), max_tokens)
    seconds = sum(interpolate(grid, t) for t in step_token_counts)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from workers.models.decoder import DecoderLM

# (rows, seconds) points, rows ascending, starting at (0, 0.0).
Grid = list[tuple[int, float]]


def size_grid(largest: int) -> list[int]:
    """Powers of two below ``largest``, then ``largest`` itself (empty for 0)."""
    sizes, n = [], 1
    while n < largest:
        sizes.append(n)
        n *= 2
    return [*sizes, largest] if largest > 0 else []


def interpolate(grid: Grid, rows: float) -> float:
    """Seconds at ``rows``, linear between grid points; the grid must cover ``rows``."""
    xs, ys = zip(*grid)
    if not 0 <= rows <= xs[-1]:
        raise ValueError(f"{rows} rows is outside the measured grid 0..{xs[-1]}")
    return float(np.interp(rows, xs, ys))


def measure_grid(timer: Callable[[int], float], largest: int, repeats: int = 3) -> Grid:
    """The median of ``repeats`` timings at every ``size_grid(largest)`` size, after one
    untimed call per size (allocator warmup)."""
    grid: Grid = [(0, 0.0)]
    for rows in size_grid(largest):
        timer(rows)
        grid.append((rows, statistics.median(timer(rows) for _ in range(repeats))))
    return grid


@torch.inference_mode()
def linear_layers_time(model: DecoderLM, num_tokens: int) -> float:
    """Seconds for every layer's QKV, O, gate-up and down projections on ``num_tokens``
    rows, through the model's own linear op and packed weights."""
    cfg, linear = model.cfg, model.ops.linear
    dtype, device = model.norm.dtype, model.norm.device
    hidden = torch.randn(num_tokens, cfg.hidden_size, dtype=dtype, device=device)
    attn = torch.randn(num_tokens, cfg.q_size, dtype=dtype, device=device)
    mlp = torch.randn(num_tokens, cfg.intermediate_size, dtype=dtype, device=device)
    start = time.perf_counter()
    for layer in model.layers:
        linear(hidden, layer.qkv_w, layer.qkv_b)
        linear(attn, layer.o_w, layer.o_b)
        linear(hidden, layer.gate_up_w)
        linear(mlp, layer.down_w)
    return time.perf_counter() - start


@torch.inference_mode()
def lm_head_time(model: DecoderLM, num_rows: int) -> float:
    """Seconds for the LM head on ``num_rows`` hidden states (the rows that get logits)."""
    hidden = torch.randn(num_rows, model.cfg.hidden_size, dtype=model.norm.dtype,
                         device=model.norm.device)
    start = time.perf_counter()
    model.ops.linear(hidden, model.lm_head)
    return time.perf_counter() - start


def roofline_seconds(model: DecoderLM, steps: Iterable[tuple[int, int]],
                     repeats: int = 3) -> float:
    """The linear layers' time summed over ``steps`` of (tokens, logit rows)."""
    steps = list(steps)
    if not steps:
        return 0.0
    body = measure_grid(lambda n: linear_layers_time(model, n), max(t for t, _ in steps), repeats)
    head = measure_grid(lambda n: lm_head_time(model, n), max(s for _, s in steps), repeats)
    return sum(interpolate(body, t) + interpolate(head, s) for t, s in steps)
