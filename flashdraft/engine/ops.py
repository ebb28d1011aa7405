"""The engine's small operators (norms, rotary, SwiGLU on the native kernel where it builds) and where its
attention runs on the native kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import native
from .settings import EngineSettings


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, with a weight [D] or one per head [G, D] for x [..., G, D]: on the native
    kernel where there is one (a few microseconds a call against torch's 10-30: a one-token step of the default
    target has 61 of them), else torch's; the same within float32 rounding."""
    if native.available():
        return native.rms_norm(x, weight, eps)
    if weight.dim() == 2:
        return F.rms_norm(x, x.shape[-1:], None, eps) * weight
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def norm_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, norm: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    """Heads x [..., G, D] RMS-normalized with one weight row per head (where `norm` [G, D] is given), then
    rotated: `x * cos + x.roll(D // 2, -1) * signed_sin`, the tables [..., 1, D] per position (`RotaryTables`). One
    native pass where there is one, else torch's operators; the same within float32 rounding."""
    if native.available() and x.shape[-1] <= 256:  # the native pass holds a normalized head on its stack
        return native.norm_rotary(x, cos, signed_sin, norm, eps)
    if norm is not None:
        x = rms_norm(x, norm, eps)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection's output [..., 2F]: one native pass where there is one, else
    torch's three operators; the same within float32 rounding."""
    if native.available():
        return native.swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryTables:
    """A rotary embedding's cos and signed sin [positions, head_dim], for positions 0..length-1 at least (grown by
    doubling; rope types whose tables depend on the position alone, `STATIC_ROPE_TYPES`). The sin table's first half
    is negated, so that rotate_half(x) * sin = x.roll(half) * signed_sin: one operator instead of four, and the same
    products."""

    def __init__(self, rotary: nn.Module, head_dim: int):
        self.rotary, self.head_dim = rotary, head_dim
        self.cos = self.sin = None

    def __call__(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < length:
            size = max(256, 2 * (self.cos.shape[0] if self.cos is not None else 0), length)
            cos, sin = self.rotary(torch.zeros(1, dtype=torch.float32), torch.arange(size)[None])
            half = self.head_dim // 2
            self.cos, self.sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self.cos, self.sin



# Attention on the native kernel (`native.causal_attention`) for steps of rows without padding of up to 4 tokens on
# one thread, up to 16 on more (BENCHMARKS.md, "Native attention"): one query over 512 keys in 45 us on one thread
# against torch's fused kernel's 75 on two; T(1) -9% after 200 cached tokens, -23% after 1,000. On one thread
# torch's blocked products win from 8 queries on. Threads share the work from PARALLEL_KEY_READS key reads on
# (`attention_key_reads`). FLASHDRAFT_NATIVE_ATTENTION=0: torch's kernel always.
NATIVE_ATTENTION_QUERIES = {"one thread": 4, "threads": 16}
PARALLEL_KEY_READS = 1024


def attention_key_reads(batch: int, n: int, heads: int, kv_heads: int, keys: int) -> int:
    """The native attention's work: its tiles (up to 4 query heads of one key/value head) times the keys each reads."""
    return batch * kv_heads * -(-n * (heads // kv_heads) // 4) * keys


def native_attention_fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether attention of these shapes runs on the native kernel here (not with FLASHDRAFT_NATIVE_ATTENTION=0)."""
    return (native.available() and native.attention_fits(heads, kv_heads, head_dim)
            and EngineSettings.from_environment().native_attention)
