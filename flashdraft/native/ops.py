"""The native operators between a layer's products (`csrc/layer_ops.c`: RMSNorm, the q/k norm with rotary
embedding, SwiGLU) and attention over a decoding step's KV cache (`csrc/attention.c`), each one call where torch
runs a chain of small operators."""

from __future__ import annotations

import torch

from .build import _build, unavailable_reason


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm(x, weight.shape, weight, eps)` for float32 CPU tensors, on the native kernel: the same within float32
    rounding, in a microsecond where torch's chain of small operators takes ~30 us a call here. `weight` [D] normalizes
    rows of D; `weight` [G, D] normalizes each of the G rows of D of x [..., G, D] with its own weight row (the q and
    k heads of a q/k/v product, which may be a view: each position's G rows contiguous, positions evenly spaced).
    Returns a contiguous tensor of x's shape."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    groups, width = (1, weight.shape[0]) if weight.dim() == 1 else tuple(weight.shape)
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.dim() > 2 \
            or tuple(x.shape[x.dim() - weight.dim():]) != tuple(weight.shape):
        raise ValueError(f"native rms_norm takes float32 CPU x [..., D] and weight [D] (or x [..., G, D] and weight "
                         f"[G, D]), not {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    weight = weight.contiguous()
    stride = _position_stride(x, groups, width)
    if stride is None:
        x = x.contiguous()
        stride = groups * width
    out = torch.empty(x.shape)
    library.rms_norm(x.data_ptr(), stride, weight.data_ptr(), groups, out.data_ptr(), x.numel() // (groups * width),
                     width, eps)
    return out


def _position_stride(x: torch.Tensor, groups: int, width: int) -> int | None:
    """The distance between the positions of x [..., G, D] when each position's G rows of D are contiguous and the
    positions evenly spaced (the q and k heads of a q/k/v product), else None."""
    if x.is_contiguous():
        return groups * width
    if groups == 1 or x.stride(-1) != 1 or x.stride(-2) != width or x.dim() == 2:
        return None
    step = expected = x.stride(-3)
    for size, stride in zip(reversed(x.shape[:-2]), reversed(x.stride()[:-2])):
        if size > 1 and stride != expected:
            return None
        expected *= size
    return step


def norm_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, norm: torch.Tensor | None = None,
                eps: float = 1e-6) -> torch.Tensor:
    """Rotary position embedding of heads x [..., G, D] (a view of a q/k/v product's q and k heads may do: each
    position's G rows contiguous, positions evenly spaced), after their RMSNorm with one weight row per head where
    `norm` [G, D] is given: `x * cos + x.roll(D // 2, -1) * signed_sin` with cos and signed_sin [..., D] per
    position (the sine's first half negated, as `engine.RotaryTables` holds it). One native pass where torch runs
    three or four operators; torch's result within float32 rounding. Returns a contiguous tensor of x's shape."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    groups, width = x.shape[-2], x.shape[-1]
    positions = x.numel() // (groups * width)
    tables = (cos, signed_sin)
    if (x.dim() < 2 or width % 2 or width > 256 or x.dtype != torch.float32 or x.device.type != "cpu"
            or any(t.dtype != torch.float32 or t.numel() != positions * width for t in tables)
            or (norm is not None and (norm.shape != (groups, width) or norm.dtype != torch.float32))):
        raise ValueError(f"native norm_rotary takes float32 CPU heads [..., G, D] (D even, at most 256), tables of "
                         f"[..., D] per position and a norm [G, D]; not {x.dtype} {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {None if norm is None else tuple(norm.shape)}")
    stride = _position_stride(x, groups, width)
    if stride is None:
        x = x.contiguous()
        stride = groups * width
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    norm = norm.contiguous() if norm is not None else None
    out = torch.empty(x.shape)
    library.norm_rotary(x.data_ptr(), stride, norm.data_ptr() if norm is not None else None, groups, eps,
                        cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), positions, width)
    return out


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` with gate, up = gate_up.chunk(2, -1) (a fused gate/up projection's output [..., 2F]), on
    the native kernel: one pass where torch runs three operators; torch's result within float32 rounding."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    if gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.shape[-1] % 2:
        raise ValueError(f"native swiglu takes a float32 CPU gate/up [..., 2F], not {gate_up.dtype} "
                         f"{tuple(gate_up.shape)} on {gate_up.device}")
    gate_up = gate_up.contiguous()
    features = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], features)
    library.swiglu(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * features), features)
    return out


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     parallel: bool = False, causal: bool = True) -> torch.Tensor:
    """Attention of a decoding step's queries over a cache, on the native kernel: `queries` [b * n, H, hd] (rows may
    be strided: q/k/v come out of one product), `keys` and `values` the cache [b, K, capacity, hd] (contiguous; H a
    multiple of K), query i of each row at position `start + i` seeing keys 0..start+i (with `causal` False every key
    up to start+n-1: a DFlash draft's block). Returns [b * n, H * hd]:
    torch's `scaled_dot_product_attention` (causal over the step, grouped-query) within float32 rounding, in a few
    microseconds where torch's takes ~25 a call. hd 64 or 128 (`attention_fits`)."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    rows, heads, head_dim = queries.shape
    batch, kv_heads, capacity, _ = keys.shape
    n = rows // batch
    if (not attention_fits(heads, kv_heads, head_dim) or rows != batch * n or start < 0 or start + n > capacity
            or keys.shape != values.shape or keys.shape[-1] != head_dim or queries.stride()[1:] != (head_dim, 1)
            or not (keys.is_contiguous() and values.is_contiguous())
            or {queries.dtype, keys.dtype, values.dtype} != {torch.float32}
            or {queries.device.type, keys.device.type, values.device.type} != {"cpu"}):
        raise ValueError(f"native attention takes float32 CPU queries [b * n, H, hd] (heads contiguous) and a "
                         f"contiguous cache [b, K, capacity, hd], H a multiple of K, hd 64 or 128, positions within "
                         f"the capacity; not {queries.dtype} {tuple(queries.shape)}, {keys.dtype} "
                         f"{tuple(keys.shape)}, start {start}")
    return unchecked_causal_attention(queries, keys, values, start, parallel, causal)


def unchecked_causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                               parallel: bool = False, causal: bool = True, first_key: torch.Tensor | None = None,
                               positions: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_attention` without its checks (~3 us of a ~10 us call), for a caller that guarantees them: the
    engine, whose cache and projections have that layout by construction. `first_key` [b] (int64, contiguous): the
    first key of each row, after its left padding (a padding query gets zeros); `positions` [b * n] (int64,
    contiguous): each query's position, where the queries of a row do not sit at start, start + 1, ... Each query
    gets the same bits in any batch, block or chunk it is computed in."""
    rows, heads, head_dim = queries.shape
    batch, kv_heads, capacity, _ = keys.shape
    out = torch.empty(rows, heads * head_dim)
    _build()[0].causal_attention(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), batch,
                                 rows // batch, heads, kv_heads, head_dim, queries.stride(0), capacity, start,
                                 first_key.data_ptr() if first_key is not None else None,
                                 positions.data_ptr() if positions is not None else None, head_dim ** -0.5,
                                 int(causal), int(parallel))
    return out


def attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `causal_attention` takes these shapes."""
    return heads % kv_heads == 0 and head_dim in (64, 128)
