"""The fast exact forward of a Llama-family target on CPU: what `TargetModel` runs instead of transformers' forward.

The same arithmetic as transformers' Llama, Qwen2 and Qwen3 (float32, same weights), organised for what a
speculative step costs on a CPU (BENCHMARKS.md, "CPU engine"): a third of a transformers one-token forward is
framework overhead, and MKL's matrix products for 2 to 16 rows (exactly a verification's shape) are its slow path.
So the engine
- runs each layer as a handful of operators: fused q/k/v and gate/up projections (the model's own weights become
  views of the fused ones, so nothing is stored twice), one rotary pass over queries and keys together, grouped
  query attention without copies (a decoding step's on the native kernel), RMSNorm and SwiGLU in one native pass;
- keeps the KV cache in preallocated tensors where rolling back a rejected block is a length (`EngineCache`);
- computes every projection through the kernel measured fastest for its weight and number of rows on this
  machine (`KernelChoice`: torch's `F.linear`, the same product transposed, numpy's BLAS, or flashdraft's own
  native kernel where a C compiler builds it, `native.py`), measured once and cached on disk like the verify
  costs;
- lets the native kernel read each weight in the fewest bytes that hold its float32 values exactly
  (`WeightForms`): a target dequantized from a GGUF checkpoint is read in its Q4_1 / Q8_0 blocks (a fifth of the
  bytes), a bfloat16 draft in bfloat16. A step of a few tokens is bound by those bytes, so this halves it; the
  products are the float32 ones, bit for bit (`FLASHDRAFT_PACKED=0` turns it off).
Every path is exact up to float32 rounding: logits match transformers' within float32 tolerance and greedy outputs
are the same (tests/test_engine.py).

A DFlash draft's pass runs here too (`DraftEngine`), in the same form on the same kernels; a bfloat16 draft's
products in 8-bit integers (AVX512_VNNI) or bfloat16 arithmetic (AVX512_BF16) where the CPU has them (proposals
never change the output, only how much of it a round accepts).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import ThreadpoolController
from torch import nn

from . import native, quantized
from .draft import DraftCache
from .files import (
    BUSY_CORES,
    COMPLETE_MARKER,
    WAITING_VARIABLES,
    cache_home,
    cached_measurement,
    other_processes_cpu,
    save_measurement,
    shape_key,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # tables that depend on the position alone
KERNEL_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # rows (tokens x sequences) measured; above: torch's own
# numpy's BLAS threads busy-wait between calls and stall badly when another process holds a core (seen here: a
# forward 20x slower); one thread, inside the engine only, never oversubscribes.
_ONE_BLAS_THREAD = ThreadpoolController().select(internal_api="openblas")
THREADING_VARIABLES = (*WAITING_VARIABLES, "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


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
        packing = native.available() and os.environ.get("FLASHDRAFT_PACKED", "1") != "0"  # 0: float32 only
        return cls(weight.numpy(), native.pack(weight) if packing else None)


ProductFn = Callable[[torch.Tensor, torch.Tensor, WeightForms], torch.Tensor]


def _torch(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    return F.linear(x, weight)


def _torch_transposed(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    # W @ x^T takes MKL's small-N gemm path, several times faster than x @ W^T for 2-8 rows here.
    return (weight @ x.T).T


def _numpy(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    # numpy's OpenBLAS: the fastest single-row product (gemv) on this CPU, by 2-3x.
    return torch.from_numpy(x.numpy() @ forms.array.T)


def _numpy_transposed(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    return torch.from_numpy(forms.array @ x.numpy().T).T


def _native(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms, parallel: bool = False) -> torch.Tensor:
    # flashdraft's own kernel: reads each weight once, so 2 to 4 rows cost what one does (csrc/small_gemm.c), and
    # reads the packed form where there is one: the same result in a fraction of the bytes.
    if forms.packed is not None:
        return native.packed_gemm(x, forms.packed, parallel)
    return native.small_gemm(x, weight, parallel)


def _native_parallel(x: torch.Tensor, weight: torch.Tensor, forms: WeightForms) -> torch.Tensor:
    # The same on torch's threads: faster where the other cores are free, slower where they are busy.
    return _native(x, weight, forms, parallel=True)


PRODUCTS: dict[str, ProductFn] = {
    "torch": _torch, "torch-t": _torch_transposed, "numpy": _numpy, "numpy-t": _numpy_transposed, "native": _native,
    "native-parallel": _native_parallel,
}


NATIVE_PRODUCTS = (_native, _native_parallel)  # what a layer in one native call (`native.decoder_layer`) runs
LAYER_KINDS = ("qkv", "o", "gate_up", "down")


def available_products() -> dict[str, ProductFn]:
    """The products this machine offers: the native kernel only where it compiles (`native.unavailable_reason`)."""
    return {name: product for name, product in PRODUCTS.items()
            if not name.startswith("native") or native.available()}


def _aligned(parameter: nn.Parameter) -> torch.Tensor:
    """The parameter's weight, its storage first moved to a 64-byte boundary (a cache line) if not there already:
    weights loaded from a checkpoint may sit anywhere, and rows that straddle cache lines cost the native kernel
    split loads (BENCHMARKS.md, "CPU engine"). The Parameter object stays, so tied weights (embedding and head) and
    the model's own forward follow it."""
    if parameter.data_ptr() % 64:
        with torch.no_grad():
            parameter.data = parameter.data.clone()
    return parameter.detach()


def _rope_type(config) -> str:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope.get("rope_type", "default")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the engine cannot run `model` exactly (then transformers' forward runs), or None when it can."""
    config = model.config.get_text_config()
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (the engine runs {', '.join(SUPPORTED_MODEL_TYPES)})"
    weight = model.get_input_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"{weight.dtype} on {weight.device.type} (the engine runs float32 on CPU)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    llama_bias = config.model_type == "llama" and getattr(config, "attention_bias", False)
    head_bias = getattr(model.get_output_embeddings(), "bias", None) is not None
    if getattr(config, "mlp_bias", False) or llama_bias or head_bias:
        return "biases the engine does not add"
    if getattr(config, "use_sliding_window", False) or any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])
    ):
        return "sliding-window attention"
    if _rope_type(config) not in STATIC_ROPE_TYPES:
        return f"rope type {_rope_type(config)!r}"
    if any(_foreign_hooks(module) for module in model.modules()):
        return "forward hooks on its modules (they would not run)"
    return None


def _foreign_hooks(module: nn.Module) -> list:
    """A module's forward hooks other than transformers' own (it records hidden states through hooks it leaves
    installed, harmless here)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [hook for hook in hooks if not getattr(hook, "__module__", "").startswith("transformers.")]


def _leading(padding: torch.Tensor) -> torch.Tensor | None:
    """[b, n] bool padding -> int64 [b] how many positions each row's padding takes, where all of it leads the
    row (left padding); None where some row has padding after a token."""
    counts = padding.sum(dim=1)
    return counts if torch.equal(padding, torch.arange(padding.shape[1])[None] < counts[:, None]) else None


class EngineCache:
    """The target's K/V for every layer in preallocated tensors: rows [b, kv_heads, capacity, head_dim] per layer,
    filled up to `length`. Rolling back is lowering the length; capacity doubles when a forward needs more.
    `padding` ([b, capacity] bool, True where a left-padded row has no token) exists only for padded batches."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, by_position: bool = False):
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype = dtype
        self.keys: torch.Tensor | None = None  # [layers, b, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None
        self.leading_padding: torch.Tensor | None = None  # int64 [b]: each row's padding, where it all leads
        self.length = 0
        # By position (sequences of different lengths decoded together, `flashdraft.batching`): each row keeps a
        # token's K/V at the token's own position and a query sees the positions up to its own, so rows need no
        # padding and a row's rollback is nothing at all (what lies past its position is never seen, then
        # overwritten). The first `rows` of the allocated rows are in use; `length` is the furthest position written.
        self.by_position = by_position
        self.rows = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[3]

    def reserve(self, batch: int, length: int) -> None:
        """Room for `length` positions of `batch` rows (keeping what is cached)."""
        allocated = 0 if self.keys is None else self.keys.shape[1]
        if self.by_position:
            if batch != self.rows:
                raise ValueError(f"this cache holds {self.rows} rows, the forward has {batch}")
            batch = max(batch, allocated)
        elif self.keys is not None and allocated != batch:
            raise ValueError(f"this cache holds {allocated} rows, the forward has {batch}")
        if length <= self.capacity and batch <= allocated:
            return
        capacity = max(256, self.capacity)
        while capacity < length:
            capacity *= 2
        layers, kv_heads, head_dim = self.shape
        keys = torch.zeros(layers, batch, kv_heads, capacity, head_dim, dtype=self.dtype)
        values = torch.zeros_like(keys)
        if self.keys is not None:
            keys[:, :allocated, :, : self.length] = self.keys[:, :, :, : self.length]
            values[:, :allocated, :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values = keys, values
        if self.padding is not None:
            self.padding = torch.cat([self.padding, self.padding.new_zeros(batch, capacity - self.padding.shape[1])], 1)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a negative `length` drops that many from the end)."""
        self.length = length if length >= 0 else max(self.length + length, 0)

    def get_seq_length(self) -> int:
        return self.length

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows `rows` (finished sequences leave a batch)."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        if self.padding is not None:
            self.padding = self.padding[rows]
        if self.leading_padding is not None:
            self.leading_padding = self.leading_padding[rows].contiguous()

    def row_kv(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s K/V at positions 0..length-1: two [layers, kv_heads, length, head_dim] views."""
        return self.keys[:, row, :, :length], self.values[:, row, :, :length]

    def add_row(self, kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """By position: a row joins as the last, holding `kv` at positions 0..n-1 (two [layers, kv_heads, n,
        head_dim] tensors, e.g. another cache's `row_kv`), or empty for None (what its slot holds lies past its
        length: never seen, then overwritten). Allocated rows double when full, so joining copies one row, not the
        batch."""
        length = 0 if kv is None else kv[0].shape[2]
        allocated = 0 if self.keys is None else self.keys.shape[1]
        if self.rows == allocated:
            self._grow_rows(max(2 * allocated, 1))
        self.rows += 1
        self.reserve(self.rows, max(self.length, length))
        if kv is not None:
            self.keys[:, self.rows - 1, :, :length] = kv[0]
            self.values[:, self.rows - 1, :, :length] = kv[1]
        self.length = max(self.length, length)

    def remove_row(self, row: int) -> None:
        """By position: row `row` leaves; the last row moves into its place."""
        last = self.rows - 1
        if row != last:
            self.keys[:, row, :, : self.length] = self.keys[:, last, :, : self.length]
            self.values[:, row, :, : self.length] = self.values[:, last, :, : self.length]
        self.rows = last

    def _grow_rows(self, allocated: int) -> None:
        layers, kv_heads, head_dim = self.shape
        keys = torch.zeros(layers, allocated, kv_heads, max(self.capacity, 256), head_dim, dtype=self.dtype)
        values = torch.zeros_like(keys)
        if self.keys is not None:
            keys[:, : self.keys.shape[1], :, : self.length] = self.keys[:, :, :, : self.length]
            values[:, : self.keys.shape[1], :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values = keys, values


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
                   kv_heads: int) -> _Layer:
    """A decoder layer's weights in the engine's form (a Llama/Qwen layer or a DFlash draft layer: the same names),
    the q/k/v and the gate/up projections each one weight made by `fuse`, the q and k norms one table."""
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
        o=_aligned(attention.o_proj.weight),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=fuse((mlp.gate_proj, mlp.up_proj)),
        down=_aligned(mlp.down_proj.weight),
    )


def _layer_products(layer: _Layer) -> tuple[torch.Tensor, ...]:
    return layer.qkv, layer.o, layer.gate_up, layer.down


def _parallel_bits(kernels: KernelChoice, window: int, rows: int, attention: bool) -> int:
    """`native.decoder_layer`'s `parallel`: which of a layer's products (q/k/v over the `window`, the rest over
    `rows`) the kernel table shares among threads, and the attention where `attention`."""
    shapes = ((1, "qkv", window), (2, "o", rows), (4, "gate_up", rows), (8, "down", rows))
    return sum(bit for bit, kind, count in shapes if kernels.product(kind, count) is _native_parallel) | (
        16 if attention else 0)


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


class KernelChoice:
    """The fastest product per weight kind and row count, measured on this machine (see `measure_kernels`)."""

    def __init__(self, table: dict[str, dict[int, str]]):
        self.table = table
        # numpy's BLAS runs on one thread inside the engine; limiting it costs ~13 us a call, paid only where used.
        self.uses_numpy = any(name.startswith("numpy") for by_rows in table.values() for name in by_rows.values())
        # Row counts between measured ones take the choice of the next measured count up.
        self.lookup = {
            kind: [PRODUCTS[by_rows[min((r for r in by_rows if r >= m), default=max(by_rows))]] if by_rows
                   else _torch for m in range(max(KERNEL_ROWS) + 1)]
            for kind, by_rows in table.items()
        }

    def product(self, kind: str, rows: int) -> ProductFn:
        choices = self.lookup.get(kind)
        return choices[rows] if choices is not None and rows < len(choices) else _torch


class KernelLinear(nn.Linear):
    """An `nn.Linear` (the same parameters, so the same state dict) whose inference product goes through the
    kernel measured fastest for its kind and row count; with gradients, or off CPU float32, it is `nn.Linear`."""

    kind = "qkv"
    kernels = KernelChoice({})

    @classmethod
    def replacing(cls, linear: nn.Linear, kind: str, kernels: KernelChoice) -> KernelLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        _aligned(linear.weight)
        new.weight, new.bias = linear.weight, linear.bias
        new.kind, new.kernels = kind, kernels
        new._forms, new._forms_of = None, None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != x.dtype:
            return super().forward(x)
        # The weight's forms, made again if it moved or changed in place (a packed copy would be stale).
        if self._forms_of != (weight.data_ptr(), weight._version):
            self._forms, self._forms_of = WeightForms.of(weight), (weight.data_ptr(), weight._version)
        rows = x.numel() // self.in_features
        product = self.kernels.product(self.kind, rows)
        if product in (_numpy, _numpy_transposed):
            with _ONE_BLAS_THREAD.limit(limits=1):
                out = product(x.reshape(rows, self.in_features), weight.detach(), self._forms)
        else:
            out = product(x.reshape(rows, self.in_features), weight.detach(), self._forms)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


# Which role each projection of a draft plays, for the kernel choice (measured on the target's projections).
_DRAFT_KINDS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                "up_proj": "gate_up", "down_proj": "down", "fc": "down"}


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
            and os.environ.get("FLASHDRAFT_NATIVE_ATTENTION", "1") != "0")


# How the target's products are computed (FLASHDRAFT_ARITHMETIC, `flashdraft generate --arithmetic`): float32, the
# same as transformers' forward; int8, the GGUF checkpoint's own blocks against activations rounded to 8-bit codes
# per 32 values (`quantized`, `csrc/block_gemm.c`), what llama.cpp computes; auto, int8 where the target has GGUF
# blocks.
ARITHMETICS = ("auto", "float32", "int8")
CHECKED_ROWS = 64  # rows of each weight compared with its blocks where a checksum covers the blocks file


def arithmetic_setting() -> str:
    return os.environ.get("FLASHDRAFT_ARITHMETIC", "auto")


def native_kernels(parallel: bool) -> KernelChoice:
    """Every product on the native kernel, shared among threads or not: int8 arithmetic's choice, which has no
    other kernels to measure against."""
    name = "native-parallel" if parallel else "native"
    return KernelChoice({kind: dict.fromkeys(KERNEL_ROWS, name) for kind in (*LAYER_KINDS, "head")})


class Engine:
    """Runs the forward of a supported model (`unsupported_reason` is None) on its own weights."""

    def __init__(self, model: nn.Module, arithmetic: str | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the CPU engine cannot run this model: {reason}")
        self.config = config = model.config.get_text_config()
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.dtype = torch.float32
        base = model.base_model
        self.head_weight = _aligned(model.get_output_embeddings().weight)
        self.embed = model.get_input_embeddings().weight
        self.norm = base.norm.weight
        self.rotary = RotaryTables(base.rotary_emb, self.head_dim)
        self.layers = [_layer_weights(layer, self._fuse, self.num_heads, self.kv_heads) for layer in base.layers]
        self.choice = arithmetic or arithmetic_setting()  # what was asked for; `arithmetic` what runs
        self.arithmetic, self.blocks = self._block_weights(model, self.choice)
        self.forms = {id(w): WeightForms.of(w) for w in self._weights() if id(w) not in self.blocks}
        self.kernels = KernelChoice({})
        if self.arithmetic == "int8":  # every product on the native kernels, on every thread there is
            self.kernels = native_kernels(torch.get_num_threads() > 1)
        self.native_attention = native_attention_fits(self.num_heads, self.kv_heads, self.head_dim)
        # Each layer one native call for the few rows of a decoding step, where every product runs on the native
        # kernel: ~30 operators' overhead a layer saved (BENCHMARKS.md, "A whole layer in one native call").
        self.native_layers = None
        if native.available() and self.native_attention:
            self.native_layers = [native.pack_layer(
                layer.input_norm, layer.post_norm, layer.qk_norm, layer.qkv_bias,
                *(self._native_weight(w) for w in _layer_products(layer)),
                self.num_heads, self.kv_heads, self.head_dim) for layer in self.layers]
        self.use_native_layers = True  # False: each layer operator by operator, for comparisons

    def _native_weight(self, weight: torch.Tensor):
        """A product's weight as the native layer reads it: its GGUF blocks (int8 arithmetic), else its exactly
        packed form, else the float32 tensor."""
        if id(weight) in self.blocks:
            return self.blocks[id(weight)]
        packed = self.forms[id(weight)].packed
        return weight if packed is None else packed

    def _block_weights(self, model: nn.Module, choice: str) -> tuple[str, dict[int, quantized.FusedBlocks]]:
        """The arithmetic this engine runs and, for int8, its products' GGUF blocks by id of the engine's weight.
        "auto" is int8 where the target comes with GGUF blocks (a registry target) and the native kernels build,
        else float32; "int8" fails, saying why, where it cannot run. A product whose GGUF type has no int8 kernel
        stays float32, said in one line."""
        if choice not in ARITHMETICS:
            raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETICS)}, got {choice!r}")
        if choice == "float32":
            return "float32", {}
        folder = Path(getattr(model, "name_or_path", "") or "")
        # Each token of a verification gets exactly what a one-token step gives it only on the native attention,
        # which computes every query alone: int8 needs it (torch's fused attention may round a row differently).
        fits = native_attention_fits(self.num_heads, self.kv_heads, self.head_dim)
        path = folder / quantized.BLOCKS_FILE  # kept by `models.prepare` beside a registry target
        if not (fits and path.is_file()):
            if choice == "int8":
                why = (f"the native kernels are unavailable ({native.unavailable_reason()})" if not native.available()
                       else "its attention does not fit the native kernel (head_dim 64 or 128)" if not fits
                       else f"{folder} holds no GGUF blocks ({quantized.BLOCKS_FILE}: registry targets have them)")
                raise ValueError(f"int8 arithmetic cannot run this target: {why}; use float32")
            return "float32", {}
        blocks = quantized.GGUFBlocks(path)
        # A prepared registry folder verifies the blocks file's checksum at every load: a sample of each weight's
        # rows then finds its order and a file of another model; any other folder's blocks are compared whole.
        marker = folder / COMPLETE_MARKER
        covered = marker.is_file() and quantized.BLOCKS_FILE in marker.read_text()
        sample = CHECKED_ROWS if covered else None
        llama = self.config.model_type == "llama"  # llama.cpp permutes a Llama's q and k rows
        weights: dict[int, quantized.FusedBlocks] = {}
        left: list[str] = []
        for index, (module, layer) in enumerate(zip(model.base_model.layers, self.layers)):
            attention, mlp = module.self_attn, module.mlp
            sources = {"qkv": ((attention.q_proj, attention.k_proj, attention.v_proj),
                               (self.num_heads, self.kv_heads, None)),
                       "o": ((attention.o_proj,), (None,)), "gate_up": ((mlp.gate_proj, mlp.up_proj), (None, None)),
                       "down": ((mlp.down_proj,), (None,))}
            for kind, (linears, heads) in sources.items():
                names = [f"blk.{index}.{tensor}.weight" for tensor in quantized.LAYER_TENSORS[kind]]
                fused = quantized.fused_blocks(blocks, names, [linear.weight for linear in linears],
                                               heads if llama else (None,) * len(linears), sample)
                if isinstance(fused, str):
                    left.append(fused)
                else:
                    weights[id(getattr(layer, kind))] = fused
        head = "output.weight" if "output.weight" in blocks.meta else "token_embd.weight"  # tied: the embedding
        fused = quantized.fused_blocks(blocks, [head], [self.head_weight], [None], sample)
        if isinstance(fused, str):
            left.append(fused)
        else:
            weights[id(self.head_weight)] = fused
        if left:
            print(f"int8 arithmetic: {len(left)} product(s) stay float32 ({left[0]})", file=sys.stderr)
        return "int8", weights

    def matches(self, model: nn.Module) -> bool:
        """Whether this engine still runs on `model`'s weights (not so after e.g. `model.to(dtype)`)."""
        layers = model.base_model.layers
        return (
            len(layers) == len(self.layers)
            and model.get_input_embeddings().weight.data_ptr() == self.embed.data_ptr()
            and all(layer.self_attn.q_proj.weight.data_ptr() == ours.qkv.data_ptr()
                    and layer.mlp.down_proj.weight.data_ptr() == ours.down.data_ptr()
                    for layer, ours in zip(layers, self.layers))
        )

    @staticmethod
    @torch.no_grad()
    def _fuse(linears: Sequence[nn.Linear]) -> torch.Tensor:
        """One weight for several projections of the same input; each projection's weight becomes a view of it."""
        fused = torch.cat([linear.weight.detach() for linear in linears])
        offset = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(fused[offset : offset + rows], requires_grad=linear.weight.requires_grad)
            offset += rows
        return fused

    def _weights(self) -> list[torch.Tensor]:
        return [self.head_weight] + [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up,
                                                                                  layer.down)]

    def packed_formats(self) -> dict[str, list[str]]:
        """The packed forms of the engine's weights by kind (`WeightForms`), e.g. {"qkv": ["q4_1"], ...}; an
        unpacked weight counts as "float32"; with int8 arithmetic, the GGUF types of the blocks, e.g. ["Q5_0",
        "Q8_0"]."""
        kinds = {"head": [self.head_weight]}
        for layer in self.layers:
            for kind in ("qkv", "o", "gate_up", "down"):
                kinds.setdefault(kind, []).append(getattr(layer, kind))
        def forms(weight: torch.Tensor) -> list[str]:
            if id(weight) in self.blocks:  # int8 arithmetic: the GGUF types
                return self.blocks[id(weight)].types
            return [getattr(self.forms[id(weight)].packed, "format", "float32")]

        return {kind: sorted({form for w in weights for form in forms(w)}) for kind, weights in kinds.items()}

    def accelerate(self, module: nn.Module) -> nn.Module:
        """Route the inference products of a draft's projections (and of a head given as `module` itself) through
        this engine's kernels: each `nn.Linear` becomes a `KernelLinear` holding the same parameters."""
        if type(module) is nn.Linear:
            return KernelLinear.replacing(module, "head", self.kernels)
        for parent in list(module.modules()):
            for name, child in parent.named_children():
                if type(child) is nn.Linear and name in _DRAFT_KINDS:
                    setattr(parent, name, KernelLinear.replacing(child, _DRAFT_KINDS[name], self.kernels))
        return module

    def new_cache(self, by_position: bool = False) -> EngineCache:
        return EngineCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, by_position)

    def _product(self, kind: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        product = self.kernels.product(kind, x.shape[0])
        if id(weight) in self.blocks:
            return quantized.block_gemm(x, self.blocks[id(weight)], parallel=product is _native_parallel)
        return product(x, weight, self.forms[id(weight)])

    def max_native_rows(self, threads: bool) -> int:
        """The most rows of a step whose attention runs on the native kernel. With int8 arithmetic, every step a
        verification takes: so each token of a block gets exactly what a one-token step gives it (the native
        attention computes each query alone), and decoding with speculation stays what plain decoding gives."""
        if self.arithmetic == "int8":
            return max(KERNEL_ROWS)
        return NATIVE_ATTENTION_QUERIES["threads" if threads else "one thread"]

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [b, n]
        position_ids: torch.Tensor,  # [b, n]
        cache: EngineCache,
        layer_ids: Sequence[int] | None = None,
        logits_to_keep: int = 0,
        padding: torch.Tensor | None = None,  # [b, n] bool, True at left padding (a padded batch's prefill)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The n new tokens after the `cache.length` cached ones. Returns logits [b, n or logits_to_keep, V] and,
        with `layer_ids`, the concatenated outputs of those layers [b, n, k*d]."""
        if not self.kernels.uses_numpy:
            return self._forward(input_ids, position_ids, cache, layer_ids, logits_to_keep, padding)
        with _ONE_BLAS_THREAD.limit(limits=1):
            return self._forward(input_ids, position_ids, cache, layer_ids, logits_to_keep, padding)

    def _forward(self, input_ids, position_ids, cache, layer_ids, logits_to_keep, padding):
        batch, n = input_ids.shape
        start, end = cache.length, cache.length + n
        if cache.by_position:  # each row at its own positions (see EngineCache)
            start, end = None, int(position_ids.max()) + 1
        cache.reserve(batch, end)
        if padding is not None:
            if cache.padding is None:
                cache.padding = torch.zeros(batch, cache.capacity, dtype=torch.bool)
            cache.padding[:, start:end] = padding
            cache.leading_padding = _leading(padding) if start == 0 else None
        heads, kv_heads, head_dim, eps = self.num_heads, self.kv_heads, self.head_dim, self.eps
        rows = batch * n
        cos, sin = self.rotary(int(position_ids.max()) + 1)
        cos, sin = cos[position_ids].view(rows, 1, head_dim), sin[position_ids].view(rows, 1, head_dim)
        visible = self._visible(cache, batch, n, start, end, position_ids)  # [b, 1, n, end] or None
        wanted = set(layer_ids or ())
        collected = []
        threads = torch.get_num_threads() > 1
        native_attention = (self.native_attention and start is not None and cache.padding is None
                            and n <= self.max_native_rows(threads))
        parallel = threads and attention_key_reads(batch, n, heads, kv_heads, end) >= PARALLEL_KEY_READS
        h = F.embedding(input_ids, self.embed).view(rows, -1)
        # Each layer one native call: one sequence, or a batch's decoding steps (a left-padded row's keys begin
        # after its padding, so each row gets what it gets alone), every product on the native kernel.
        native_layers = (self.native_layers is not None and self.use_native_layers and start is not None
                         and n <= self.max_native_rows(threads)
                         and (cache.padding is None or (padding is None and cache.leading_padding is not None))
                         and all(self.kernels.product(kind, rows) in NATIVE_PRODUCTS for kind in LAYER_KINDS))
        if native_layers:
            bits = _parallel_bits(self.kernels, rows, rows, parallel)
            first_key = cache.leading_padding if cache.padding is not None else None
            for index, layer in enumerate(self.native_layers):
                native.unchecked_decoder_layer(layer, cache.keys[index], cache.values[index], h, None,
                                               cos.view(rows, head_dim), sin.view(rows, head_dim), start, eps,
                                               parallel=bits, first_key=first_key, batch=batch)
                if index in wanted:
                    collected.append(h.clone())  # h changes in place
        for index, layer in enumerate(() if native_layers else self.layers):  # else operator by operator
            qkv = self._product("qkv", rms_norm(h, layer.input_norm, eps), layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qkv = qkv.reshape(rows, heads + 2 * kv_heads, head_dim)
            qk = norm_rotary(qkv[:, : heads + kv_heads], cos, sin, layer.qk_norm, eps)  # queries and keys at once
            keys, values = cache.keys[index][:batch], cache.values[index][:batch]  # [b, K, capacity, hd]
            if start is None:  # by position: row r's token i goes to column position_ids[r, i]
                rows_index = torch.arange(batch)[:, None]
                keys.transpose(1, 2)[rows_index, position_ids] = qk[:, heads:].view(batch, n, kv_heads, head_dim)
                values.transpose(1, 2)[rows_index, position_ids] = qkv[:, heads + kv_heads :].view(
                    batch, n, kv_heads, head_dim)
            else:
                keys[:, :, start:end] = qk[:, heads:].view(batch, n, kv_heads, head_dim).transpose(1, 2)
                values[:, :, start:end] = qkv[:, heads + kv_heads :].view(batch, n, kv_heads, head_dim).transpose(1, 2)
            if native_attention:
                attended = native.unchecked_causal_attention(qk[:, :heads], keys, values, start, parallel)
            else:
                attended = self._attention(qk[:, :heads], keys[:, :, :end], values[:, :, :end], visible, batch, n)
            h = h + self._product("o", attended, layer.o)
            gate_up = self._product("gate_up", rms_norm(h, layer.post_norm, eps), layer.gate_up)
            h = h + self._product("down", swiglu(gate_up), layer.down)
            if index in wanted:
                collected.append(h)
        cache.length = max(cache.length, end) if start is None else end
        h = h.view(batch, n, -1)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        kept = h.shape[1]
        hidden = rms_norm(h, self.norm, eps).reshape(batch * kept, -1)
        features = None
        if layer_ids:
            by_layer = dict(zip(sorted(wanted), collected))
            last = len(self.layers) - 1
            if last in by_layer:  # transformers reports the last layer's output after the final norm
                by_layer[last] = rms_norm(by_layer[last], self.norm, eps)
            features = torch.cat([by_layer[i] for i in layer_ids], dim=-1).view(batch, n, -1)
        logits = self._product("head", hidden, self.head_weight).reshape(batch, kept, -1)
        return logits, features

    def _attention(self, queries, keys, values, visible, batch: int, n: int) -> torch.Tensor:
        """queries [b*n, H, hd], keys and values [b, K, end, hd], `visible` [b, 1, n, end] bool or None (all)
        -> [b*n, H*hd]. torch's fused kernel, grouped-query without copying keys and values per head: the fastest
        here for one query (23 us against 39 for two batched products, at 129 keys)."""
        attended = F.scaled_dot_product_attention(
            queries.view(batch, n, -1, keys.shape[-1]).transpose(1, 2), keys, values, attn_mask=visible,
            enable_gqa=queries.shape[1] != keys.shape[1],
        )  # [b, H, n, hd]
        return attended.transpose(1, 2).reshape(batch * n, -1)

    @staticmethod
    def _visible(cache: EngineCache, batch: int, n: int, start: int | None, end: int,
                 position_ids: torch.Tensor) -> torch.Tensor | None:
        """[b, 1, n, end] bool, True where a query may attend: every cached position and its block up to itself,
        never a padded position (but always itself, so that a padding query's row is not empty). None when a
        single query sees everything. By position (`start` None): the columns up to the query's own position."""
        if start is None:
            return (torch.arange(end)[None, None, :] <= position_ids[:, :, None])[:, None]
        if n == 1 and cache.padding is None:
            return None
        keys = torch.arange(end)
        queries = torch.arange(start, end)
        visible = (keys[None, :] <= queries[:, None]).expand(batch, n, end)  # [b, n, end]
        if cache.padding is not None:
            itself = keys[None, None, :] == queries[None, :, None]
            visible = (visible & ~cache.padding[:, None, :end]) | itself
        return visible[:, None]


class DraftEngine:
    """A DFlash draft's inference pass (`DFlashDraftModel.forward` without gradients) on a target engine's kernels:
    the module's arithmetic in the target engine's form (BENCHMARKS.md, "How threads wait, and the draft pass on
    the engine"): q/k/v
    computed for the whole window [context ; block] in one product (the queries of the context rows come for free
    with a kernel that reads each weight once, and are dropped), gate/up in one, every norm one operator, q/k
    norms and rotary in one native pass, the block's attention on the native kernel where it fits (else torch's
    fused kernel). The fused weights are copies, made again whenever the
    draft's parameters move or change in place, so a draft in training keeps its own parameters and its optimizer's
    hold on them. Use `for_draft`, which says None where the module's own forward must run."""

    def __init__(self, draft: nn.Module, engine: Engine):
        config = draft.config
        self.draft, self.engine = draft, engine
        self.num_heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                        config.head_dim)
        self.eps = config.rms_norm_eps
        self.rotary = RotaryTables(draft.rotary_emb, self.head_dim)
        self.native_attention = native_attention_fits(self.num_heads, self.kv_heads, self.head_dim)
        self.parameters = list(draft.parameters())
        self._made_from = None
        # bfloat16 arithmetic for the products of bfloat16 weights, where the CPU has it: a draft's proposals
        # never change the output, and its 8-row products are bound by arithmetic (BENCHMARKS.md, "How threads
        # wait, and the draft pass on the engine"). FLASHDRAFT_DRAFT_BF16=0: float32 arithmetic, the module's results.
        self.bf16_dot = native.bf16_dot_available() and os.environ.get("FLASHDRAFT_DRAFT_BF16", "1") != "0"
        # A shipped (bfloat16) draft's products go further, in 8-bit integers: its weights rounded to GGUF's Q8_0
        # form (one scale per 32), its activations to 8-bit codes per 32, on the int8 kernel the target's int8
        # arithmetic runs on (`quantized.block_gemm`: AVX-512 VNNI, AVX2 or plain C). FLASHDRAFT_DRAFT_INT8=0:
        # bfloat16 arithmetic.
        self.int8_dot = native.available() and os.environ.get("FLASHDRAFT_DRAFT_INT8", "1") != "0"
        self._head: tuple | None = None  # (made from, packed head) for `logits`
        self._whole: tuple | None = None  # (made from, native.DraftWeights) for `block`
        self.use_native_layers = True  # False: the layer step by step, for comparisons
        self.use_whole_pass = True  # False: `block` declines (the layers native, the rest in torch), for comparisons

    @classmethod
    def for_draft(cls, draft: nn.Module, engine: Engine | None) -> DraftEngine | None:
        """The draft's pass on `engine`, or None where only the module runs it: no engine, a draft off CPU
        float32, with sliding-window layers, attention biases or a rope whose tables move with the sequence."""
        config = draft.config
        if (engine is None or draft.dtype != torch.float32 or draft.device.type != "cpu" or config.attention_bias
                or config.hidden_act != "silu" or _rope_type(config) not in STATIC_ROPE_TYPES
                or "sliding_attention" in config.layer_types):
            return None
        return cls(draft, engine)

    def _weights(self) -> None:
        """The fused copies and their forms, made again when a parameter moved (`.to`, a new `.data`) or changed
        in place (an optimizer step, `load_state_dict`): a parameter's version counts every in-place change."""
        made_from = [(p.data_ptr(), p._version) for p in self.parameters]
        if made_from == self._made_from:
            return
        draft = self.draft
        self.layers = [_layer_weights(layer, _concatenated, self.num_heads, self.kv_heads) for layer in draft.layers]
        self.fc = _aligned(draft.fc.weight)
        self.hidden_norm, self.norm = draft.hidden_norm.weight.detach(), draft.norm.weight.detach()
        weights = [self.fc] + [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.forms = {id(w): WeightForms.of(w) for w in weights}
        # A draft whose weights are all bfloat16 values (as shipped) also reads its head in bfloat16 arithmetic; one
        # in training (float32 weights) stays in float32 throughout.
        self.bfloat16_weights = all(getattr(f.packed, "format", None) == "bf16" for f in self.forms.values())
        self.int8 = ({id(w): quantized.q8_blocks(w) for w in weights if quantized.fits(w)}
                     if self.int8_dot and self.bfloat16_weights else {})
        self.native_layers = None  # each layer one native call, where all its products are 8-bit
        if self.native_attention and all(id(w) in self.int8 for layer in self.layers for w in _layer_products(layer)):
            self.native_layers = [native.pack_layer(layer.input_norm, layer.post_norm, layer.qk_norm, layer.qkv_bias,
                                                    *(self.int8[id(w)] for w in _layer_products(layer)), self.num_heads,
                                                    self.kv_heads, self.head_dim) for layer in self.layers]
        self._made_from = [(p.data_ptr(), p._version) for p in self.parameters]  # after `_aligned`'s moves

    def _product(self, kind: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        forms, product = self.forms[id(weight)], self.engine.kernels.product(kind, x.shape[0])
        if id(weight) in self.int8:
            return quantized.block_gemm(x, self.int8[id(weight)], parallel=product is _native_parallel)
        packed = forms.packed
        if self.bf16_dot and packed is not None and packed.format == "bf16" and not weight.shape[1] % native.BLOCK:
            return native.bf16_dot_gemm(x, packed, parallel=product is _native_parallel)
        return product(x, weight, forms)

    def _packed_head(self, head: nn.Linear) -> native.PackedWeight | quantized.FusedBlocks | None:
        """The head's weight rounded for the draft's arithmetic (8-bit, else bfloat16; made again when the weight
        changes), or None where the head runs as it is: a draft not in bfloat16 values (in training), a bias."""
        weight = head.weight
        int8 = bool(self.int8) and quantized.fits(weight)
        if (not ((self.bf16_dot or int8) and self.bfloat16_weights) or head.bias is not None
                or weight.dtype != torch.float32 or weight.shape[1] % native.BLOCK):
            return None
        made_from = (weight.data_ptr(), weight._version, int8)
        if self._head is None or self._head[0] != made_from:
            self._head = made_from, (quantized.q8_blocks if int8 else native.pack_bfloat16)(weight.detach())
        return self._head[1]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        """`head(hidden)` for the draft's final hidden states [rows, d] (after a pass, so `_weights` is current);
        for a bfloat16 draft with bfloat16 (or 8-bit) arithmetic, through a copy of the head's weight rounded so."""
        packed = self._packed_head(head)
        if packed is None:
            return head(hidden.to(head.weight.dtype))
        parallel = self.engine.kernels.product("head", hidden.shape[0]) is _native_parallel
        multiply = quantized.block_gemm if packed.format == "blocks" else native.bf16_dot_gemm
        return multiply(hidden, packed, parallel)

    @torch.no_grad()
    def block(self, block_ids: list[int], features: torch.Tensor, first_position: int, cache: DraftCache,
              head: nn.Linear, embedding: nn.Module, rows: slice,
              vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole pass for one sequence in a single native call (`native.draft_block`): the block `block_ids`
        embedded by `embedding`, the new context `features` [1, w, k d] at positions first_position.., every
        layer, the final norm and `head` for the block's `rows`. Returns their logits [rows, V_head] and each
        row's argmax (as ids of `vocab_ids` where given); None where the pass does not run so (layers not all
        8-bit, a head or an embedding of another kind), and `__call__` with `logits` must. The same result, bit
        for bit, as that pair: the same kernels in the same order, without the ~15 torch operators around the
        layers (a quarter of the pass once the target's step has evicted them from the caches)."""
        self._weights()
        if (self.native_layers is None or not (self.use_native_layers and self.use_whole_pass)
                or type(embedding) is not nn.Embedding
                or embedding.weight.dtype != torch.float32 or features.shape[0] != 1 or id(self.fc) not in self.int8):
            return None
        head_weight = self._packed_head(head)
        if head_weight is None or head_weight.format != "blocks":
            return None
        made_from = (self._made_from, self._head[0], embedding.weight.data_ptr(), embedding.weight._version)
        if self._whole is None or self._whole[0] != made_from:
            self._whole = made_from, native.pack_draft(self.native_layers, self.int8[id(self.fc)], self.hidden_norm,
                                                       self.norm, head_weight, embedding.weight.detach())
        block, width = len(block_ids), features.shape[1]
        end = first_position + width + block
        cos, sin = self.rotary(end)
        start = cache.claim(width + block)
        threads = torch.get_num_threads() > 1
        kernels = self.engine.kernels
        parallel = _parallel_bits(kernels, width + block, block, threads and attention_key_reads(
            1, block, self.num_heads, self.kv_heads, start + width + block) >= PARALLEL_KEY_READS)
        first, stop = rows.indices(block)[:2]
        parallel |= (32 if kernels.product("down", width) is _native_parallel else 0) | (
            64 if kernels.product("head", stop - first) is _native_parallel else 0)
        return native.unchecked_draft_block(self._whole[1], [k[0] for k in cache.keys], [v[0] for v in cache.values],
                                            block_ids, features[0].contiguous(), cos[first_position:end],
                                            sin[first_position:end], start, self.eps, first, stop - first, vocab_ids,
                                            parallel)

    @torch.no_grad()
    def __call__(
        self,
        noise_embedding: torch.Tensor,  # [b, q, d]
        target_hidden: torch.Tensor,  # [b, c, k*d]
        position_ids: torch.Tensor,  # [b, c + q]
        cache=None,  # DraftCache or RowDraftCache (their `update`)
        attention_mask: torch.Tensor | None = None,  # bool [b, 1, q, end], True = visible
    ) -> torch.Tensor:
        """`DFlashDraftModel.forward`: the block's final hidden states [b, q, d]."""
        if not self.engine.kernels.uses_numpy:
            return self._forward(noise_embedding, target_hidden, position_ids, cache, attention_mask)
        with _ONE_BLAS_THREAD.limit(limits=1):
            return self._forward(noise_embedding, target_hidden, position_ids, cache, attention_mask)

    def _forward(self, noise_embedding, target_hidden, position_ids, cache, attention_mask):
        self._weights()
        heads, kv_heads, head_dim, eps = self.num_heads, self.kv_heads, self.head_dim, self.eps
        batch, q_len, d = noise_embedding.shape
        width = target_hidden.shape[1]
        n = width + q_len
        context = self._product("down", target_hidden.reshape(batch * width, -1), self.fc)
        context = rms_norm(context, self.hidden_norm, eps).view(batch, width, d)
        cos, sin = self.rotary(int(position_ids.max()) + 1)
        cos, sin = cos[position_ids].unsqueeze(2), sin[position_ids].unsqueeze(2)  # [b, n, 1, hd]
        h = noise_embedding.reshape(batch * q_len, d)
        threads = torch.get_num_threads() > 1
        if (self.native_layers is not None and self.use_native_layers and batch == 1 and attention_mask is None
                and isinstance(cache, DraftCache)):
            return self._native_layers(h, context[0], cos[0, :, 0], sin[0, :, 0], cache, threads)
        native_attention = (self.native_attention and batch == 1 and attention_mask is None
                            and isinstance(cache, DraftCache)
                            and q_len <= NATIVE_ATTENTION_QUERIES["threads" if threads else "one thread"])
        for index, layer in enumerate(self.layers):
            normed = rms_norm(h, layer.input_norm, eps).view(batch, q_len, d)
            window = torch.cat([context, normed], dim=1).view(batch * n, d)
            qkv = self._product("qkv", window, layer.qkv).view(batch, n, heads + 2 * kv_heads, head_dim)
            qk = norm_rotary(qkv[:, :, : heads + kv_heads], cos, sin, layer.qk_norm, eps)  # q and k norms, rotary
            queries = qk[:, width:, :heads].transpose(1, 2)  # the block's queries only: [b, H, q, hd]
            keys, values = qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv_heads :].transpose(1, 2)
            if cache is not None:
                keys, values = cache.update(keys, values, index)
            if native_attention:  # the cache's whole buffers, the block at its end seeing all of itself
                end = keys.shape[2]
                attended = native.unchecked_causal_attention(
                    qk[0, width:, :heads], cache.keys[index], cache.values[index], end - q_len,
                    parallel=threads and attention_key_reads(1, q_len, heads, kv_heads, end) >= PARALLEL_KEY_READS,
                    causal=False)
            else:
                attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attention_mask,
                                                          enable_gqa=heads != kv_heads)  # [b, H, q, hd]
                attended = attended.transpose(1, 2).reshape(batch * q_len, -1)
            h = h + self._product("o", attended, layer.o)
            gate_up = self._product("gate_up", rms_norm(h, layer.post_norm, eps), layer.gate_up)
            h = h + self._product("down", swiglu(gate_up), layer.down)
        return rms_norm(h, self.norm, eps).view(batch, q_len, d)

    def _native_layers(self, h, context, cos, sin, cache: DraftCache, threads: bool) -> torch.Tensor:
        """`_forward` for one sequence whose layers are each one native call (`native.decoder_layer`): the
        same kernels in the same order, without the ~30 operators' overhead a layer costs in Python (half the
        pass; BENCHMARKS.md, "A whole layer in one native call")."""
        block, width = h.shape[0], context.shape[0]
        h = h.clone(memory_format=torch.contiguous_format)  # updated in place
        start = cache.claim(width + block)
        parallel = _parallel_bits(self.engine.kernels, width + block, block, threads and attention_key_reads(
            1, block, self.num_heads, self.kv_heads, start + width + block) >= PARALLEL_KEY_READS)
        for index, layer in enumerate(self.native_layers):
            native.decoder_layer(layer, cache.keys[index][0], cache.values[index][0], h, context, cos, sin, start,
                                 self.eps, causal=False, parallel=parallel)
        return rms_norm(h, self.norm, self.eps).view(1, block, -1)


def _concatenated(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """One weight for several projections of the same input, as a copy (the draft's parameters stay its own)."""
    return torch.cat([linear.weight.detach() for linear in linears])


def measure_kernels(engine: Engine, repeats: int = 3, progress: Callable[[int], None] | None = None) -> KernelChoice:
    """Choose each product's kernel by row count, in two steps. Alone: every kernel on the engine's own weights
    (cycling through all layers, so that weights stream from memory as in a forward), the fastest per weight kind.
    Then in context: whole forwards with that choice against each kernel for every product, the fastest kept;
    BLAS thread pools that spin (torch's OpenMP without OMP_WAIT_POLICY=PASSIVE) can make a kernel that wins alone
    lose between torch's operators, and only a whole forward shows it."""
    weights = {
        "qkv": [layer.qkv for layer in engine.layers], "o": [layer.o for layer in engine.layers],
        "gate_up": [layer.gate_up for layer in engine.layers], "down": [layer.down for layer in engine.layers],
        "head": [engine.head_weight],
    }
    context = 128
    ids = torch.randint(0, engine.embed.shape[0], (1, context + max(KERNEL_ROWS)))
    positions = torch.arange(ids.shape[1])[None]
    cache = engine.new_cache()
    engine.kernels = KernelChoice({})
    engine.forward(ids[:, :context], positions[:, :context], cache, logits_to_keep=1)
    table: dict[str, dict[int, str]] = {kind: {} for kind in weights}
    products = available_products()
    for rows in KERNEL_ROWS:
        if progress:
            progress(rows)
        alone = {}
        for kind, kind_weights in weights.items():
            x = torch.randn(rows, kind_weights[0].shape[1])
            seconds = interleaved_seconds(
                {name: partial(_products, product, x, kind_weights, engine.forms)
                 for name, product in products.items()},
                repeats,
            )
            alone[kind] = min(seconds, key=seconds.__getitem__)
        candidates = [alone] + [dict.fromkeys(weights, name) for name in products]
        window = slice(context, context + rows)
        seconds = interleaved_seconds(
            {i: partial(_forward_with, engine, {kind: {rows: name} for kind, name in candidate.items()},
                        ids[:, window], positions[:, window], cache) for i, candidate in enumerate(candidates)},
            repeats,
        )
        for kind, name in candidates[min(seconds, key=seconds.__getitem__)].items():
            table[kind][rows] = name
    engine.kernels = KernelChoice(table)
    return engine.kernels


def _products(product: ProductFn, x: torch.Tensor, weights: list[torch.Tensor], forms: dict) -> None:
    for weight in weights:
        product(x, weight, forms[id(weight)])


def _forward_with(engine: Engine, table: dict, input_ids: torch.Tensor, positions: torch.Tensor,
                  cache: EngineCache) -> None:
    """One forward with the kernels of `table`, rolled back."""
    engine.kernels = KernelChoice(table)
    engine.forward(input_ids, positions, cache)
    cache.crop(-input_ids.shape[1])


def interleaved_seconds(works: dict, repeats: int, summary: Callable[[list[float]], float] = min) -> dict:
    """Seconds of each work, run in turns (a rotating order, after one warm-up turn) so that a change in the
    machine's load touches them all alike, summarised over the `repeats` turns. The least by default: other
    processes only ever add time, and a choice made once and cached must not follow the load of the moment it was
    measured."""
    times: dict = {key: [] for key in works}
    keys = list(works)
    for turn in range(repeats + 1):
        for key in keys[turn % len(keys):] + keys[: turn % len(keys)]:
            began = time.perf_counter()
            works[key]()
            if turn:
                times[key].append(time.perf_counter() - began)
    return {key: summary(spent) for key, spent in times.items()}


def cached_kernels(engine: Engine, progress: bool = True) -> KernelChoice:
    """`measure_kernels`, once per model shape, thread count and library versions, then read from disk."""
    identity = json.dumps(
        {
            "model": shape_key(engine.config),
            "threads": torch.get_num_threads(),
            # Whether torch's threads spin between operators decides which kernels win (see measure_kernels).
            "environment": {name: os.environ.get(name) for name in THREADING_VARIABLES},
            "torch": torch.__version__,
            "numpy": np.__version__,
            "native": native.build_identity(),
            # Packed weights change which kernel wins.
            "packed": engine.packed_formats(),
        },
        sort_keys=True,
    )
    path = cache_home() / "kernels" / f"{hashlib.sha256(identity.encode()).hexdigest()[:20]}.json"
    saved = cached_measurement(path)
    if saved is not None:
        try:
            table = {kind: {int(m): name for m, name in by_rows.items()} for kind, by_rows in saved.items()}
            if all(name in available_products() for by_rows in table.values() for name in by_rows.values()):
                return KernelChoice(table)
        except (ValueError, AttributeError):
            pass  # a damaged file is measured again and replaced
    from tqdm.auto import tqdm

    busy = other_processes_cpu() >= BUSY_CORES
    with tqdm(total=len(KERNEL_ROWS), desc="measuring this machine's fastest kernels (once per model shape)",
              unit="shape", leave=False, disable=not progress) as bar:
        choice = measure_kernels(engine, progress=lambda rows: bar.update())
    save_measurement(path, choice.table, busy)
    return choice
