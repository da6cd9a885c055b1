"""A fake ``torch_npu`` for CPU tests (never the real package: without CANN its mere
presence breaks ``import torch``).

Each op has the signature the torch_npu documentation gives (so a wrong keyword is a
TypeError, as on a device), checks its inputs' shapes, dtypes and formats, records the
call, and computes its result on the CPU: the norms, activation and rotary with our
reference ops; the KV write and the attention ops straight from their definitions (slot
arithmetic, the NZ index formula, softmax over the block table's context), so that a
mistake in how the backend lays out its inputs shows up as a different result. ``torch.npu``
is a fake too: device queries, memory, streams and events, all recorded.
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from workers import device as device_module
from workers.ops.torch_ref import TorchOps

ACL_FORMAT_FRACTAL_NZ = 29
_REF = TorchOps()


@dataclass
class Call:
    name: str
    args: dict[str, Any]


@dataclass
class FakeNpuState:
    soc: str
    free_bytes: int
    total_bytes: int
    calls: list[Call] = field(default_factory=list)
    formats: dict[int, int] = field(default_factory=dict)   # storage ptr -> acl format

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    @property
    def nz(self) -> bool:
        return "310P" in self.soc


def _fail(op: str, what: str) -> None:
    raise RuntimeError(f"fake torch_npu.{op}: {what}")


def _check(op: str, ok: bool, what: str) -> None:
    if not ok:
        _fail(op, what)


def _format(state: FakeNpuState, t: torch.Tensor) -> int | None:
    """The ACL format of ``t``'s allocation: a K or V half of a pool layer allocated in
    NZ is NZ too (its storage is the same bytes either way, its last two dims being one
    fractal column of tiles)."""
    return state.formats.get(t.untyped_storage().data_ptr())


def _nd_cache(state: FakeNpuState, cache: torch.Tensor, kvh: int, hd: int) -> torch.Tensor:
    """The cache as ND [nb, bs, kvh, hd], read by the NZ index formula where it is NZ."""
    if not state.nz:
        return cache
    nb, n1, bs, c0 = cache.shape
    cols = torch.arange(kvh * hd)
    nd = cache[:, cols // c0, :, cols % c0]          # [n, nb, bs] (advanced dims first)
    return nd.permute(1, 2, 0).reshape(nb, bs, kvh, hd)


def _check_cache(state: FakeNpuState, op: str, cache: torch.Tensor, kvh: int, hd: int) -> None:
    if state.nz:
        c0 = 32 // cache.element_size()
        _check(op, cache.dim() == 4 and cache.shape[1] == -(-kvh * hd // c0)
               and cache.shape[3] == c0, f"NZ cache of shape {tuple(cache.shape)}; expected "
               f"(num_blocks, {kvh * hd // c0}, block_size, {c0})")
        _check(op, _format(state, cache) == ACL_FORMAT_FRACTAL_NZ,
               "a 310P cache must be allocated in format 29 (FRACTAL_NZ)")
    else:
        _check(op, cache.dim() == 4 and tuple(cache.shape[2:]) == (kvh, hd),
               f"ND cache of shape {tuple(cache.shape)}; expected (num_blocks, block_size, "
               f"{kvh}, {hd})")


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            bias: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] over keys/values [L, KVH, D] with an additive bias [n, L]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.to(q.dtype).repeat_interleave(group, dim=1)
    v = values.to(q.dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale + bias.to(q.dtype)
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)


def _context(cache_nd: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    nb, bs = -(-length // cache_nd.shape[1]), cache_nd.shape[1]
    return cache_nd[table[:nb].long()].reshape(nb * bs, *cache_nd.shape[2:])[:length]


def _causal_bias(n: int, length: int) -> torch.Tensor:
    rows = torch.arange(n)[:, None] + (length - n)
    return torch.zeros(n, length).masked_fill_(torch.arange(length)[None, :] > rows, float("-inf"))


def make_module(state: FakeNpuState) -> types.ModuleType:
    def record(name: str, **args: Any) -> None:
        state.calls.append(Call(name, args))

    def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        op = "_npu_reshape_and_cache"
        record(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
               slot_indices=slot_indices)
        t, kvh, hd = key.shape
        _check(op, value.shape == key.shape, "key and value shapes differ")
        _check(op, key.dtype == key_cache.dtype == value_cache.dtype,
               f"key {key.dtype} into a {key_cache.dtype} cache")
        _check(op, slot_indices.dtype == torch.int32 and slot_indices.shape == (t,),
               f"slot_indices {slot_indices.dtype} {tuple(slot_indices.shape)}; "
               f"expected int32 ({t},)")
        for cache, x in ((key_cache, key), (value_cache, value)):
            _check_cache(state, op, cache, kvh, hd)
            slots = slot_indices.long()
            if state.nz:
                bs, c0 = cache.shape[2], cache.shape[3]
                cols = torch.arange(kvh * hd)
                cache[(slots // bs)[:, None], (cols // c0)[None], (slots % bs)[:, None],
                      (cols % c0)[None]] = x.reshape(t, -1)
            else:
                bs = cache.shape[1]
                cache[slots // bs, slots % bs] = x

    def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads,
                             scale_value, block_table, context_lens, out):
        op = "_npu_paged_attention"
        record(op, query=query, key_cache=key_cache, value_cache=value_cache,
               num_kv_heads=num_kv_heads, num_heads=num_heads, scale_value=scale_value,
               block_table=block_table, context_lens=context_lens, out=out)
        d, h, hd = query.shape
        _check(op, h == num_heads and h % num_kv_heads == 0, "head counts do not match query")
        _check(op, block_table.dtype == torch.int32 and block_table.shape[0] == d,
               f"block_table {block_table.dtype} {tuple(block_table.shape)}")
        _check(op, context_lens.dtype == torch.int32 and context_lens.shape == (d,),
               "context_lens must be int32, one per query")
        _check(op, out.shape == query.shape and out.dtype == query.dtype, "out mismatch")
        keys = _nd_cache(state, key_cache, num_kv_heads, hd)
        values = _nd_cache(state, value_cache, num_kv_heads, hd)
        for i in range(d):
            n = int(context_lens[i])
            out[i] = _attend(query[i:i + 1], _context(keys, block_table[i], n),
                             _context(values, block_table[i], n), scale_value,
                             torch.zeros(1, n))[0]

    def npu_fused_infer_attention_score(
            query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
            actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
            dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
            antiquant_offset=None, block_table=None, query_padding_size=None,
            kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
            value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
            value_shared_prefix=None, actual_shared_prefix_len=None, num_heads=1, scale=1.0,
            pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
            num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
            antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
            value_antiquant_mode=0):
        op = "npu_fused_infer_attention_score"
        record(op, query=query, key=key, value=value, atten_mask=atten_mask,
               actual_seq_lengths=actual_seq_lengths,
               actual_seq_lengths_kv=actual_seq_lengths_kv, block_table=block_table,
               num_heads=num_heads, scale=scale, input_layout=input_layout,
               num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode,
               block_size=block_size)
        _check(op, input_layout == "TND" and query.dim() == 3, "expected TND query [T, N, D]")
        t, h, hd = query.shape
        kvh = num_key_value_heads
        _check(op, block_table is not None and block_table.dtype == torch.int32,
               "expected an int32 block_table")
        _check(op, key.dim() == 3 and key.shape[1] == block_size and key.shape[2] == kvh * hd,
               f"paged key {tuple(key.shape)}; expected (num_blocks, {block_size}, {kvh * hd})")
        _check(op, sparse_mode == 3 and atten_mask is not None
               and atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
               and torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1)),
               "sparse_mode 3 takes the 2048x2048 upper-triangular bool mask")
        ends = list(actual_seq_lengths)
        _check(op, ends == sorted(ends) and ends[-1] == t and len(ends) == block_table.shape[0]
               == len(actual_seq_lengths_kv), "actual_seq_lengths: cumulative, one per batch")
        keys = key.view(key.shape[0], block_size, kvh, hd)
        values = value.view(value.shape[0], block_size, kvh, hd)
        out = torch.empty_like(query)
        start = 0
        for i, (end, length) in enumerate(zip(ends, actual_seq_lengths_kv)):
            n = end - start
            out[start:end] = _attend(query[start:end], _context(keys, block_table[i], length),
                                     _context(values, block_table[i], length), scale,
                                     _causal_bias(n, length))
            start = end
        return out, torch.zeros(t, h, 1)

    def _npu_paged_attention_splitfuse(query, key_cache, value_cache, mask, block_table,
                                       seq_len, context_lens, num_kv_heads, num_heads,
                                       scale_value, out):
        op = "_npu_paged_attention_splitfuse"
        record(op, query=query, key_cache=key_cache, value_cache=value_cache, mask=mask,
               block_table=block_table, seq_len=seq_len, context_lens=context_lens,
               num_kv_heads=num_kv_heads, num_heads=num_heads, scale_value=scale_value,
               out=out)
        t, h, hd = query.shape
        _check(op, _format(state, mask) == ACL_FORMAT_FRACTAL_NZ
               and mask.dtype == torch.float16, "the mask must be fp16 cast to NZ")
        _check(op, int(seq_len.sum()) == t and seq_len.dtype == context_lens.dtype == torch.int32,
               "seq_len must be int32 query lengths summing to the tokens")
        n1, _, c0 = mask.shape
        cols = torch.arange(n1 * c0)
        rows = mask[cols // c0, :, cols % c0].transpose(0, 1)[:t]   # NZ read back: [t, n]
        keys = _nd_cache(state, key_cache, num_kv_heads, hd)
        values = _nd_cache(state, value_cache, num_kv_heads, hd)
        start = 0
        for i, (n, length) in enumerate(zip(seq_len.tolist(), context_lens.tolist())):
            out[start:start + n] = _attend(
                query[start:start + n], _context(keys, block_table[i], length),
                _context(values, block_table[i], length), scale_value,
                rows[start:start + n, :length].float())
            start += n

    def npu_rms_norm(self, gamma, epsilon=1e-6):
        record("npu_rms_norm", self=self, gamma=gamma, epsilon=epsilon)
        _check("npu_rms_norm", gamma.shape == self.shape[-1:], "gamma must match the last dim")
        return _REF.rms_norm(self, gamma, epsilon), torch.empty(0)

    def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
        record("npu_add_rms_norm", x1=x1, x2=x2, gamma=gamma, epsilon=epsilon)
        _check("npu_add_rms_norm", x1.shape == x2.shape and x1.dtype == x2.dtype,
               "x1 and x2 differ")
        x, y = _REF.add_rms_norm(x1, x2, gamma, epsilon)
        return y, torch.empty(0), x

    def npu_swiglu(self, dim=-1):
        record("npu_swiglu", self=self, dim=dim)
        _check("npu_swiglu", dim == -1 and self.shape[-1] % 2 == 0, "split the last dim")
        return _REF.silu_and_mul(self)

    def _npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
        op = "_npu_rotary_embedding"
        record(op, positions=positions, query=query, key=key, head_size=head_size,
               cos_sin_cache=cos_sin_cache, is_neox_style=is_neox_style)
        _check(op, query.dim() == 2 and key.dim() == 2 and query.is_contiguous()
               and key.is_contiguous(), "query/key must be contiguous [T, heads*head_size]")
        _check(op, cos_sin_cache.shape[-1] == head_size and is_neox_style, "cos|sin cache")
        half = head_size // 2
        cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
        t = query.shape[0]
        q, k = _REF.rotary(query.view(t, -1, head_size), key.view(t, -1, head_size),
                           positions, cos, sin)
        query.copy_(q.reshape(t, -1))
        key.copy_(k.reshape(t, -1))

    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
        """Per-token symmetric int8 as documented: scale = row_max(|x|) / 127, y =
        round(x / scale); float16/bfloat16 inputs of more than one dim."""
        op = "npu_dynamic_quant"
        record(op, x=x, smooth_scales=smooth_scales, group_index=group_index,
               dst_type=dst_type)
        _check(op, x.dim() > 1 and x.dtype in (torch.float16, torch.bfloat16),
               f"x {x.dtype} of {x.dim()} dims; expected float16/bfloat16, 2+ dims")
        _check(op, dst_type in (None, torch.int8) and group_index is None,
               "only int8 without MoE groups is modelled")
        xf = x.float()
        if smooth_scales is not None:
            _check(op, smooth_scales.shape == x.shape[-1:] and smooth_scales.dtype == x.dtype,
                   "smooth_scales: 1-D over x's last dim, x's dtype")
            xf = xf * smooth_scales.float()
        scale = xf.abs().amax(dim=-1) / 127
        y = torch.round(xf / torch.where(scale > 0, scale, 1)[..., None])
        return y.clamp(-128, 127).to(torch.int8), scale

    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                         output_dtype=None, x1_dtype=None, x2_dtype=None,
                         pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None):
        """``(x1 @ x2) * pertoken_scale[:, None] * scale + bias`` for int8 x1 [m, k] and
        x2 [k, n], the product exact (int64 here, int32 on the device), the rest in
        float32."""
        op = "npu_quant_matmul"
        record(op, x1=x1, x2=x2, scale=scale, offset=offset, pertoken_scale=pertoken_scale,
               bias=bias, output_dtype=output_dtype)
        _check(op, x1.dtype == x2.dtype == torch.int8 and x1.dim() == x2.dim() == 2
               and x1.shape[1] == x2.shape[0],
               f"x1 {x1.dtype} {tuple(x1.shape)}, x2 {x2.dtype} {tuple(x2.shape)}; "
               "expected int8 [m, k] and [k, n]")
        m, n = x1.shape[0], x2.shape[1]
        _check(op, scale.dim() == 1 and scale.shape[0] in (1, n) and scale.dtype ==
               torch.float32, f"scale {scale.dtype} {tuple(scale.shape)}; expected float32 "
               f"(1,) or ({n},)")
        _check(op, offset is None, "offset is not modelled")
        _check(op, pertoken_scale is None or not state.nz,
               "Atlas inference cards (310P) take no pertoken_scale")
        _check(op, pertoken_scale is not None and pertoken_scale.dtype == torch.float32
               and pertoken_scale.shape == (m,), "expected a float32 pertoken_scale (m,)")
        _check(op, output_dtype in (torch.float16, torch.bfloat16),
               f"output_dtype {output_dtype}: with pertoken_scale, float16 or bfloat16")
        _check(op, bias is None or (bias.shape == (n,) and bias.dtype in
                                    (torch.int32, torch.float32, output_dtype)),
               f"bias {None if bias is None else (bias.dtype, tuple(bias.shape))}")
        # The dequantization in float32 (the device's), the output rounded once.
        out = (x1.long() @ x2.long()).float() * pertoken_scale[:, None] * scale[None, :]
        if bias is not None:
            out += bias.float()
        return out.to(output_dtype)

    def npu_format_cast(input, acl_format):
        record("npu_format_cast", input=input, acl_format=acl_format)
        state.formats[input.untyped_storage().data_ptr()] = acl_format
        return input

    def empty_with_format(size, dtype=None, layout=None, device=None, pin_memory=None,
                          acl_format=2):
        record("empty_with_format", size=tuple(size), dtype=dtype, acl_format=acl_format)
        t = torch.empty(size, dtype=dtype)
        state.formats[t.untyped_storage().data_ptr()] = acl_format
        return t

    module = types.ModuleType("torch_npu")
    for fn in (_npu_reshape_and_cache, _npu_paged_attention, npu_fused_infer_attention_score,
               _npu_paged_attention_splitfuse, npu_rms_norm, npu_add_rms_norm, npu_swiglu,
               _npu_rotary_embedding, npu_dynamic_quant, npu_quant_matmul, npu_format_cast,
               empty_with_format):
        setattr(module, fn.__name__, fn)
    module.fake_state = state
    return module


class FakeStream:
    def __init__(self, state: FakeNpuState, name: str) -> None:
        self.state, self.name = state, name

    def wait_event(self, event: FakeEvent) -> None:
        self.state.calls.append(Call("stream.wait_event", {"stream": self.name,
                                                          "event": event.name}))


class FakeEvent:
    count = 0

    def __init__(self, state: FakeNpuState) -> None:
        FakeEvent.count += 1
        self.state, self.name = state, f"event{FakeEvent.count}"

    def record(self, stream: FakeStream | None = None) -> None:
        self.state.calls.append(Call("event.record", {"event": self.name,
                                                      "stream": stream and stream.name}))

    def synchronize(self) -> None:
        self.state.calls.append(Call("event.synchronize", {"event": self.name}))


def make_npu_namespace(state: FakeNpuState) -> types.SimpleNamespace:
    compute = FakeStream(state, "compute")
    current = [compute]
    streams = iter(range(1, 1000))

    @contextlib.contextmanager
    def stream(s: FakeStream):
        state.calls.append(Call("stream.enter", {"stream": s.name}))
        current.append(s)
        try:
            yield
        finally:
            current.pop()
            state.calls.append(Call("stream.exit", {"stream": s.name}))

    def record(name: str, value: Any = None, **args: Any) -> Any:
        state.calls.append(Call(f"npu.{name}", args))
        return value

    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        set_device=lambda d: record("set_device", device=d),
        get_device_name=lambda d=None: state.soc,
        mem_get_info=lambda d=None: record("mem_get_info", (state.free_bytes,
                                                            state.total_bytes), device=d),
        Stream=lambda device=None: FakeStream(state, f"side{next(streams)}"),
        Event=lambda: FakeEvent(state),
        stream=stream,
        current_stream=lambda device=None: current[-1],
        manual_seed_all=lambda seed: None,   # torch.manual_seed seeds every backend
        _is_in_bad_fork=lambda: False,
    )


def install(monkeypatch, soc: str = "Ascend910B3", free_bytes: int = 8 << 20,
            total_bytes: int = 16 << 20, without: tuple[str, ...] = ()) -> FakeNpuState:
    """Make ``import torch_npu`` and ``torch.npu`` the fakes for one test; ``without``
    removes ops (an older torch_npu release). Build tiny HF models first: transformers'
    accelerate probes for torch_npu when first imported."""
    state = FakeNpuState(soc, free_bytes, total_bytes)
    module = make_module(state)
    for name in without:
        delattr(module, name)
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", make_npu_namespace(state), raising=False)
    # What torch_npu does at import, so that torch.device("npu") parses (process-wide,
    # and only a name: no tensor can be placed there).
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    device_module.npu_available.cache_clear()
    return state
