"""Packed weights: a float32 weight held exactly in fewer bytes (GGUF's Q4_1 or Q8_0 blocks of a weight dequantized
from them, or bfloat16), which the native products read instead of its float32 copy (`csrc/f32_products.c`); and a
draft's weights rounded to bfloat16 for its bfloat16 products. Pure torch: nothing here needs the library."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Packed weights (csrc/f32_products.c, csrc/kernels.h): the format's code in the kernel, and the block of weights
# along K that shares one scale.
FORMATS = {"bf16": 1, "q8_0": 2, "q4_1": 3}
BLOCK = 32
LANES_PER_VECTOR = 16  # the kernel unpacks whole vectors of 16 weights: K must be a multiple


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight [N, K] held exactly in fewer bytes (see `pack`): what the native kernel reads instead; or,
    for a draft's products only, rounded to bfloat16 (`pack_bfloat16`)."""

    format: str
    shape: tuple[int, int]
    data: torch.Tensor  # bf16: int16 [N, K]; q8_0: int8 [N, K]; q4_1: uint8 [N, K / 2]
    scale: torch.Tensor | None = None  # float32 [N, K / 32]
    minimum: torch.Tensor | None = None  # float32 [N, K / 32], q4_1 only

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum) if t is not None)

    def unpack(self) -> torch.Tensor:
        """The float32 weight again (in torch, for tests and checks)."""
        n, k = self.shape
        if self.format == "bf16":
            return self.data.view(torch.bfloat16).float()
        if self.format == "q8_0":
            return torch.mul(self.data.float().view(n, k // BLOCK, BLOCK), self.scale[..., None]).view(n, k)
        low, high = self.data.view(n, k // BLOCK, BLOCK // 2) & 15, self.data.view(n, k // BLOCK, BLOCK // 2) >> 4
        q = torch.cat([low, high], dim=-1).float()
        return torch.add(torch.mul(self.scale[..., None], q), self.minimum[..., None]).view(n, k)


def _float16_neighbours(values: torch.Tensor) -> list[torch.Tensor]:
    """The float16 value nearest each of `values` and the two either side of it, as float32: the candidates for a
    block's scale, which quantizers store in float16."""
    bits = values.half().view(torch.int16)
    return [(bits + step).view(torch.float16).float() for step in (0, 1, -1)]


def _blocks_by_candidates(blocks: torch.Tensor, candidates: list[torch.Tensor], rebuild) -> tuple | None:
    """For each block, the first candidate scale whose quantization `rebuild(scale) -> (q, values)` gives the block's
    values exactly. Returns (scale, q) for all blocks, or None when some block has no such scale."""
    scale = torch.zeros(blocks.shape[:-1] + (1,))
    q_all = torch.zeros(blocks.shape, dtype=torch.int16)
    found = torch.zeros(blocks.shape[:-1] + (1,), dtype=torch.bool)
    for candidate in candidates:
        q, values = rebuild(candidate)
        exact = (values == blocks).all(-1, keepdim=True) & ~found
        scale = torch.where(exact, candidate, scale)
        q_all = torch.where(exact, q, q_all)
        found |= exact
        if bool(found.all()):
            return scale[..., 0], q_all
    return None


def _pack_q4_1(weight: torch.Tensor) -> PackedWeight | None:
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)
    minimum = blocks.amin(-1, keepdim=True)
    if not torch.equal(minimum.half().float(), minimum):  # GGUF stores it in float16: not a Q4_1 weight
        return None

    def rebuild(scale):
        q = torch.where(scale > 0, (blocks - minimum) / scale, 0.0).round_().clamp_(0, 15)
        return q.to(torch.int16), torch.add(torch.mul(scale, q), minimum)  # two roundings, as GGUF's dequantization

    found = _blocks_by_candidates(blocks, _float16_neighbours((blocks.amax(-1, keepdim=True) - minimum) / 15), rebuild)
    if found is None:
        return None
    scale, q = found
    data = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).to(torch.uint8).reshape(n, k // 2)
    return PackedWeight("q4_1", (n, k), data, scale.contiguous(), minimum[..., 0].contiguous())


def _pack_q8_0(weight: torch.Tensor) -> PackedWeight | None:
    n, k = weight.shape
    blocks = weight.view(n, k // BLOCK, BLOCK)

    def rebuild(scale):
        q = torch.where(scale > 0, blocks / scale, 0.0).round_().clamp_(-128, 127)
        return q.to(torch.int16), torch.mul(q, scale)

    found = _blocks_by_candidates(blocks, _float16_neighbours(blocks.abs().amax(-1, keepdim=True) / 127), rebuild)
    if found is None:
        return None
    scale, q = found
    return PackedWeight("q8_0", (n, k), q.to(torch.int8).reshape(n, k), scale.contiguous())


def pack_bfloat16(weight: torch.Tensor) -> PackedWeight:
    """`weight` (float32 [N, K]) rounded to bfloat16 (to nearest) and packed so: exact only for a bfloat16 weight
    (`pack` checks that), an approximation for `bf16_dot_gemm` otherwise."""
    return PackedWeight("bf16", tuple(weight.shape), weight.bfloat16().view(torch.int16).contiguous())


def _pack_bf16(weight: torch.Tensor) -> PackedWeight | None:
    packed = pack_bfloat16(weight)
    return packed if torch.equal(packed.unpack(), weight) else None


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """`weight` (float32 [N, K]) in the most compact form that holds every one of its values exactly: GGUF's Q4_1
    (0.75 bytes a weight here) or Q8_0 (1.125) for a weight dequantized from those, bfloat16 (2) for a bfloat16 one;
    None when no form does (or the shape does not suit one). Cheap for weights that are none of these: each form
    is first tried on a few rows."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    weight = weight.detach().contiguous()
    n, k = weight.shape
    if k % LANES_PER_VECTOR:
        return None
    packers = ([_pack_q4_1, _pack_q8_0] if k % BLOCK == 0 else []) + [_pack_bf16]
    for packer in packers:
        if packer(weight[:8]) is not None:
            packed = packer(weight)
            if packed is not None:
                return packed
    return None
