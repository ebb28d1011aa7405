"""The engine's form of a model's weights: each product's other forms (numpy's view, the exactly packed copy), a
decoder layer's weights fused (q/k/v, gate/up), weights moved onto cache lines."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import native
from .settings import EngineSettings


@dataclass(frozen=True)
class WeightForms:
    """A weight's other forms, made once: numpy's view of it (for numpy's BLAS), and the same values packed in fewer
    bytes where they allow it (`native.pack`: a weight dequantized from a GGUF checkpoint, or a bfloat16 one), which
    the native kernel reads instead."""

    array: np.ndarray
    packed: native.PackedWeight | None

    @classmethod
    def of(cls, weight: torch.Tensor) -> WeightForms:
        weight = weight.detach()
        packing = native.available() and EngineSettings.from_environment().packed  # off: float32 only
        return cls(weight.numpy(), native.pack(weight) if packing else None)


def _aligned(parameter: nn.Parameter) -> torch.Tensor:
    """The parameter's weight, its storage first moved to a 64-byte boundary (a cache line) if not there already:
    weights loaded from a checkpoint may sit anywhere, and rows that straddle cache lines cost the native kernel
    split loads (BENCHMARKS.md, "CPU engine"). The Parameter object stays, so tied weights (embedding and head) and
    the model's own forward follow it."""
    if parameter.data_ptr() % 64:
        with torch.no_grad():
            parameter.data = parameter.data.clone()
    return parameter.detach()


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2K) * hd, d]: q, k and v projections fused
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # Qwen3's per-head q and k norms, [H + K, hd]: both one operator
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * I, d]: gate and up projections fused
    down: torch.Tensor


def _layer_weights(layer: nn.Module, fuse: Callable[[Sequence[nn.Linear]], torch.Tensor], heads: int,
                   kv_heads: int, single: Callable[[nn.Parameter], torch.Tensor] = _aligned) -> _Layer:
    """A decoder layer's weights in the engine's form (a Llama/Qwen layer or a DFlash draft layer: the same names),
    the q/k/v and the gate/up projections each one weight made by `fuse`, o and down by `single`, the q and k norms
    one table."""
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    qkv_bias = None
    if attention.q_proj.bias is not None:
        qkv_bias = torch.cat([p.bias.detach() for p in projections])
    q_norm = getattr(attention, "q_norm", None)
    qk_norm = None
    if q_norm is not None:
        qk_norm = torch.cat([q_norm.weight.detach().expand(heads, -1),
                             attention.k_norm.weight.detach().expand(kv_heads, -1)])
    return _Layer(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=fuse(projections),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        o=single(attention.o_proj.weight),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=fuse((mlp.gate_proj, mlp.up_proj)),
        down=single(mlp.down_proj.weight),
    )


def _placeholder(parameters: Sequence[nn.Parameter]) -> torch.Tensor:
    """What stands for a product's float32 weight (one projection's, or several fused) while the engine may read it
    as GGUF blocks: its shape and an identity, no memory (a meta tensor: computing with it fails loudly)."""
    return torch.empty(sum(p.shape[0] for p in parameters), parameters[0].shape[1], device="meta")


def _layer_products(layer: _Layer) -> tuple[torch.Tensor, ...]:
    return layer.qkv, layer.o, layer.gate_up, layer.down


def _concatenated(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """One weight for several projections of the same input, as a copy (the draft's parameters stay its own)."""
    return torch.cat([linear.weight.detach() for linear in linears])

