"""The native matrix products for the few rows of a speculative step (`csrc/f32_products.c`): float32 weights
(`small_gemm`), the same values packed in fewer bytes (`packed_gemm`, bit for bit the same result), and a draft's
products in bfloat16 arithmetic (`bf16_dot_gemm`)."""

from __future__ import annotations

import torch

from .build import _build, unavailable_reason
from .packing import BLOCK, FORMATS, PackedWeight


def small_gemm(x: torch.Tensor, weight: torch.Tensor, parallel: bool = False) -> torch.Tensor:
    """`x @ weight.T` for a float32 CPU `x` [M, K] and a contiguous `weight` [N, K], on the native kernel: on the
    calling thread, or with `parallel` shared among torch's threads (the same result either way)."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    if {x.dtype, weight.dtype} != {torch.float32} or {x.device.type, weight.device.type} != {"cpu"}:
        raise ValueError(f"the native kernel takes float32 CPU tensors, not {x.dtype} on {x.device} and "
                         f"{weight.dtype} on {weight.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"the native kernel multiplies [M, K] by [N, K]^T, not {tuple(x.shape)} by "
                         f"{tuple(weight.shape)}^T")
    if not weight.is_contiguous():
        raise ValueError("the native kernel reads the weight in place: it must be contiguous")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    function = library.small_gemm_parallel if parallel else library.small_gemm
    function(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return out


def packed_gemm(x: torch.Tensor, weight: PackedWeight, parallel: bool = False) -> torch.Tensor:
    """`x @ W.T` for the float32 weight W that `weight` packs, on the native kernel: the same result, bit for bit,
    as `small_gemm(x, W)`, reading a fraction of the bytes."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"the native kernel multiplies float32 [M, {weight.shape[1]}] on CPU by the packed weight, "
                         f"not {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    function = library.packed_gemm_parallel if parallel else library.packed_gemm
    scale = weight.scale.data_ptr() if weight.scale is not None else None
    minimum = weight.minimum.data_ptr() if weight.minimum is not None else None
    function(FORMATS[weight.format], x.data_ptr(), weight.data.data_ptr(), scale, minimum, out.data_ptr(),
             x.shape[0], weight.shape[0], x.shape[1])
    return out


def bf16_dot_available() -> bool:
    """Whether the kernel was built with bfloat16 dot products (a CPU with AVX512_BF16, e.g. AMD Zen 4, Intel
    Cooper Lake and Sapphire Rapids), for `bf16_dot_gemm`."""
    library = _build()[0]
    return library is not None and bool(library.bf16_dot_available())


def bf16_dot_gemm(x: torch.Tensor, weight: PackedWeight, parallel: bool = False) -> torch.Tensor:
    """`x @ W.T` in bfloat16 arithmetic for a bfloat16-packed W: x rounded to bfloat16 (to nearest), each pair of
    products summed into float32. Not the float32 product (x loses its low bits): for a draft's proposals, never
    for the target's logits. K must be a multiple of 32 (`BLOCK`)."""
    if not bf16_dot_available():
        raise RuntimeError("bfloat16 dot products are unavailable here: the native kernel was not built for a CPU "
                           f"with AVX512_BF16 ({unavailable_reason() or 'this CPU lacks it'})")
    _check_dot_inputs("bf16_dot_gemm", x, weight, "bf16", BLOCK)
    rounded = x.to(torch.bfloat16).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0])
    library = _build()[0]
    function = library.bf16_dot_gemm_parallel if parallel else library.bf16_dot_gemm
    function(rounded.data_ptr(), weight.data.data_ptr(), out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
    return out


def _check_dot_inputs(name: str, x: torch.Tensor, weight: PackedWeight, form: str, k_multiple: int) -> None:
    """A draft product's inputs: a `form`-packed weight with K a multiple of `k_multiple`, x float32 [M, K] on CPU."""
    if weight.format != form or weight.shape[1] % k_multiple:
        raise ValueError(f"{name} takes a {form}-packed weight with K a multiple of {k_multiple}, not "
                         f"{weight.format} {weight.shape}")
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name} multiplies float32 [M, {weight.shape[1]}] on CPU by the packed weight, "
                         f"not {x.dtype} {tuple(x.shape)} on {x.device}")
