"""Whole passes in one native call (`csrc/fused_layers.c`): a decoder layer (`pack_layer`, `decoder_layer`) and a
DFlash draft's whole pass (`pack_draft`, `draft_block`), each bit for bit the kernels called one by one. The
`unchecked_` forms skip the checks for the engine, whose tensors have the layout by construction."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .build import _build, _DecoderLayer, _DraftWeights, _LayerWeight, available, unavailable_reason
from .ops import attention_fits
from .packing import FORMATS, PackedWeight

# a product's weight in `decoder_layer` (csrc: layer_weight)
LAYER_FORMATS = {"float32": 0, **FORMATS, "blocks": 5}


@dataclass
class DecoderLayer:
    """One decoder layer's weights for `decoder_layer` (make it with `pack_layer`): the kernel's table of pointers,
    the tensors they point into (held here, so that they live as long as it) and the layer's shapes."""

    table: _DecoderLayer
    tensors: tuple
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int


def _layer_weight(what: str, weight, expected: tuple[int, int]) -> _LayerWeight:
    """A product's weight as the native layer kernels read it (csrc: layer_weight), checked against its shape."""
    if getattr(weight, "format", None) == "blocks":  # GGUF blocks for int8 arithmetic (`quantized.FusedBlocks`)
        table = _LayerWeight(LAYER_FORMATS["blocks"], ctypes.addressof(weight.tables), None, None, weight.shape[0],
                             len(weight.parts))
        form, shape, usable = "blocks", tuple(weight.shape), True
    elif isinstance(weight, PackedWeight):
        form, shape, usable = weight.format, tuple(weight.shape), True
        table = _LayerWeight(LAYER_FORMATS[form], weight.data.data_ptr(),
                             weight.scale.data_ptr() if weight.scale is not None else None,
                             weight.minimum.data_ptr() if weight.minimum is not None else None, shape[0])
    else:
        form, shape = "float32", tuple(weight.shape)
        usable = weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
        table = _LayerWeight(0, weight.data_ptr(), None, None, shape[0])
    if not usable or shape != expected:
        raise ValueError(f"{what} must be {expected} (float32 and contiguous, packed, or in 8-bit blocks), not "
                         f"{form} {shape}")
    return table


def pack_layer(input_norm: torch.Tensor, post_norm: torch.Tensor, qk_norm: torch.Tensor | None,
               qkv_bias: torch.Tensor | None, qkv: torch.Tensor | PackedWeight, o: torch.Tensor | PackedWeight,
               gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight, heads: int, kv_heads: int,
               head_dim: int) -> DecoderLayer:
    """A Llama/Qwen-style layer (or a DFlash draft's) for `decoder_layer`: its norms (float32 [d]; the q/k norms
    [heads + kv_heads, head_dim] or None), the q/k/v bias or None, and its products, each a float32 weight or a
    packed one (`pack`'s exact forms), or GGUF-style blocks for int8 products (`quantized.FusedBlocks`): q/k/v fused
    [(heads + 2 kv_heads) head_dim, d], o [d, heads head_dim], gate/up fused [2F, d], down [d, F]."""
    if not attention_fits(heads, kv_heads, head_dim):
        raise ValueError(f"a native layer takes heads a multiple of the key/value heads and head_dim 64 or 128, not "
                         f"{heads} heads over {kv_heads} of {head_dim}")
    d, features = input_norm.shape[0], gate_up.shape[0] // 2
    products = {"qkv": qkv, "o": o, "gate_up": gate_up, "down": down}
    expected = {"qkv": ((heads + 2 * kv_heads) * head_dim, d), "o": (d, heads * head_dim),
                "gate_up": (2 * features, d), "down": (d, features)}
    table = {name: _layer_weight(f"a native layer's {name}", weight, expected[name])
             for name, weight in products.items()}
    vectors = {"input_norm": (input_norm, (d,)), "post_norm": (post_norm, (d,)),
               "qk_norm": (qk_norm, (heads + kv_heads, head_dim)),
               "qkv_bias": (qkv_bias, ((heads + 2 * kv_heads) * head_dim,))}
    kept = {}
    for name, (vector, shape) in vectors.items():
        if vector is not None and (vector.dtype != torch.float32 or tuple(vector.shape) != shape):
            raise ValueError(f"a native layer's {name} must be float32 {shape}, not {vector.dtype} "
                             f"{tuple(vector.shape)}")
        kept[name] = vector.contiguous() if vector is not None else None
    pointers = [v.data_ptr() if v is not None else None for v in kept.values()]
    return DecoderLayer(_DecoderLayer(*pointers, *table.values()), (*kept.values(), *products.values()), d, heads,
                        kv_heads, head_dim)


def decoder_layer(layer: DecoderLayer, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                  context: torch.Tensor | None, cos: torch.Tensor, signed_sin: torch.Tensor, start: int, eps: float,
                  causal: bool = True, parallel: int = 0, first_key: torch.Tensor | None = None) -> None:
    """One decoder layer in a single native call, for the few rows of a decoding step: `hidden` [q, d] (updated in
    place) over the window [context ; hidden] (`context` [w, d], already normalized rows that give keys and values
    but no queries: a DFlash draft's new context; None for a target), whose keys and values go to the layer's cache
    `keys`/`values` [kv_heads, capacity, head_dim] at positions start..start+w+q-1; each query attends over the cache
    up to its own position (`causal`) or to the window's end (a draft's block). `cos`/`signed_sin` [w + q, head_dim]
    (`RotaryTables` rows of the window's positions). Bits of `parallel` share among threads: 1 q/k/v, 2 o, 4
    gate/up, 8 down, 16 attention. The same result, bit for bit, as the same kernels called one by one.

    Several sequences at once (a batch, without a context): a cache [b, kv_heads, capacity, head_dim], `hidden`
    [b * q, d] (each sequence's q rows in turn), tables [b * q, head_dim], and `first_key` (int64 [b], or None for
    0) the first cache position each sequence sees, after its left padding: each row's result is the one it gets
    alone."""
    library = _build()[0]
    if library is None:
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    d, kv_heads, head_dim = layer.hidden_size, layer.kv_heads, layer.head_dim
    if context is None:
        context = hidden[:0]
    batch = keys.shape[0] if keys.dim() == 4 else 1
    rows, width, capacity = hidden.shape[0], context.shape[0], keys.shape[-2]
    block = rows // batch
    tensors = (keys, values, hidden, context, cos, signed_sin)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or hidden.shape != (batch * block, d) or context.shape != (width, d) or (batch > 1 and width)
            or keys.shape != values.shape or keys.shape[-3:] != (kv_heads, capacity, head_dim)
            or cos.shape != signed_sin.shape or cos.shape != (width + rows, head_dim) or start < 0
            or start + width + block > capacity):
        raise ValueError(f"decoder_layer takes contiguous float32 CPU hidden [q, {d}], context [w, {d}], a cache "
                         f"[{kv_heads}, capacity, {head_dim}] with room for the window at {start}, and tables [w + q, "
                         f"{head_dim}] (or for b sequences without a context, hidden [b * q, {d}], a cache [b, "
                         f"{kv_heads}, capacity, {head_dim}] and tables [b * q, {head_dim}]); not "
                         f"{tuple(hidden.shape)}, {tuple(context.shape)}, {tuple(keys.shape)}, {tuple(cos.shape)}")
    if first_key is not None and (first_key.dtype != torch.int64 or tuple(first_key.shape) != (batch,)
                                  or not first_key.is_contiguous() or bool((first_key < 0).any())
                                  or bool((first_key > start).any())):
        raise ValueError(f"decoder_layer's first_key must be int64 [{batch}], each between 0 and the window's start "
                         f"{start}, not {first_key.dtype} {tuple(first_key.shape)}")
    unchecked_decoder_layer(layer, keys, values, hidden, context, cos, signed_sin, start, eps, causal, parallel,
                            first_key, batch)


def unchecked_decoder_layer(layer: DecoderLayer, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                            context: torch.Tensor | None, cos: torch.Tensor, signed_sin: torch.Tensor, start: int,
                            eps: float, causal: bool = True, parallel: int = 0, first_key: torch.Tensor | None = None,
                            batch: int = 1, positions: torch.Tensor | None = None) -> None:
    """`decoder_layer` without its checks, for a caller that guarantees them: the engine, whose caches and tables
    have that layout by construction. `positions` (int64 [b * q], contiguous; no context): each row's own position
    in a cache that holds each sequence at its own positions (continuous batching), where its keys and values go
    and up to which its query sees."""
    rows = hidden.shape[0]
    width = context.shape[0] if context is not None else 0
    _build()[0].decoder_layer(ctypes.byref(layer.table), keys.data_ptr(), values.data_ptr(), hidden.data_ptr(),
                              context.data_ptr() if context is not None else None, batch, width, rows // batch,
                              layer.hidden_size, layer.heads, layer.kv_heads, layer.head_dim, cos.data_ptr(),
                              signed_sin.data_ptr(), keys.shape[-2], start,
                              first_key.data_ptr() if first_key is not None else None,
                              positions.data_ptr() if positions is not None else None, eps, int(causal), parallel)


@dataclass
class DraftWeights:
    """A DFlash draft's weights for `draft_block` (make them with `pack_draft`): the kernel's table and what it
    points into, held here so that they live as long as it."""

    table: _DraftWeights
    tensors: tuple
    layers: list[DecoderLayer]
    feature_size: int  # the target features' width the fc reads: (target layers read) x hidden size
    vocab_size: int  # the head's rows
    embedding_rows: int


def pack_draft(layers: list[DecoderLayer], fc: torch.Tensor | PackedWeight, hidden_norm: torch.Tensor,
               norm: torch.Tensor, head: torch.Tensor | PackedWeight, embedding: torch.Tensor) -> DraftWeights:
    """A DFlash draft for `draft_block`: its layers (`pack_layer`), fc [d, k d] and head [V, d] (float32, packed,
    or 8-bit, as a layer's products), its norms (float32 [d]) and the target's input embedding [vocab, d]."""
    first = layers[0]
    d = first.hidden_size
    if any((layer.hidden_size, layer.heads, layer.kv_heads, layer.head_dim)
           != (d, first.heads, first.kv_heads, first.head_dim) for layer in layers):
        raise ValueError("a native draft's layers must all have the same shapes")
    fc_shape, head_shape = tuple(fc.shape), tuple(head.shape)
    fc_table = _layer_weight("a native draft's fc", fc, (d, fc_shape[1]))
    head_table = _layer_weight("a native draft's head", head, (head_shape[0], d))
    for name, vector, shape in (("hidden_norm", hidden_norm, (d,)), ("norm", norm, (d,)),
                                ("embedding", embedding, (embedding.shape[0], d))):
        if vector.dtype != torch.float32 or vector.device.type != "cpu" or tuple(vector.shape) != shape:
            raise ValueError(f"a native draft's {name} must be float32 {shape} on the CPU, not {vector.dtype} "
                             f"{tuple(vector.shape)}")
    hidden_norm, norm, embedding = hidden_norm.contiguous(), norm.contiguous(), embedding.contiguous()
    tables = (_DecoderLayer * len(layers))(*(layer.table for layer in layers))
    table = _DraftWeights(tables, len(layers), fc_table, head_table, hidden_norm.data_ptr(), norm.data_ptr(),
                          embedding.data_ptr())
    return DraftWeights(table, (tables, fc, head, hidden_norm, norm, embedding), layers, fc_shape[1], head_shape[0],
                        embedding.shape[0])


def draft_block(draft: DraftWeights, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                block_ids: Sequence[int], features: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                start: int, eps: float, first: int, rows: int, vocab_ids: torch.Tensor | None = None,
                parallel: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A DFlash draft's whole pass for one sequence in a single native call: the block `block_ids` embedded,
    the new context `features` [w, k d] through fc and its norm, every layer (`decoder_layer`, the block seeing
    all of itself; layer i's cache `keys[i]`/`values[i]` [kv_heads, capacity, head_dim] written at start..start+w+q-1),
    the final norm and head for the block's rows first..first+rows-1. Returns their logits [rows, V] and each
    row's first largest (as an id of `vocab_ids` where given). `cos`/`signed_sin` [w + q, head_dim]. Bits of
    `parallel`: the layers' (`decoder_layer`), 32 fc, 64 the head. The same, bit for bit, as those steps one by one."""
    if not available():
        raise RuntimeError(f"the native kernel is unavailable: {unavailable_reason()}")
    layer = draft.layers[0]
    block, width = len(block_ids), features.shape[0]
    if len(keys) != len(draft.layers) or len(values) != len(draft.layers):
        raise ValueError(f"draft_block takes a cache for each of the draft's {len(draft.layers)} layers, not "
                         f"{len(keys)} and {len(values)}")
    capacity = keys[0].shape[1]
    cache_shape = (layer.kv_heads, capacity, layer.head_dim)
    tensors = (*keys, *values, features, cos, signed_sin)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or any(tuple(t.shape) != cache_shape for t in (*keys, *values))
            or tuple(features.shape) != (width, draft.feature_size) or cos.shape != signed_sin.shape
            or tuple(cos.shape) != (width + block, layer.head_dim) or start < 0 or start + width + block > capacity
            or not 0 <= first <= first + rows <= block or rows < 1
            or not all(0 <= token < draft.embedding_rows for token in block_ids)):
        raise ValueError(f"draft_block takes contiguous float32 CPU features [w, {draft.feature_size}], caches "
                         f"[{layer.kv_heads}, capacity, {layer.head_dim}] with room for the window at {start}, tables "
                         f"[w + q, {layer.head_dim}], block ids below {draft.embedding_rows} and rows within the "
                         f"block; not {tuple(features.shape)}, {tuple(keys[0].shape)}, {tuple(cos.shape)}, "
                         f"{list(block_ids)}, rows {first}..{first + rows - 1}")
    if vocab_ids is not None and (vocab_ids.dtype != torch.int64 or tuple(vocab_ids.shape) != (draft.vocab_size,)):
        raise ValueError(f"draft_block's vocab_ids must be int64 [{draft.vocab_size}], not {vocab_ids.dtype} "
                         f"{tuple(vocab_ids.shape)}")
    return unchecked_draft_block(draft, keys, values, block_ids, features, cos, signed_sin, start, eps, first, rows,
                                 vocab_ids.contiguous() if vocab_ids is not None else None, parallel)


def unchecked_draft_block(draft: DraftWeights, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                          block_ids: Sequence[int], features: torch.Tensor, cos: torch.Tensor,
                          signed_sin: torch.Tensor, start: int, eps: float, first: int, rows: int,
                          vocab_ids: torch.Tensor | None = None,
                          parallel: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_block` without its checks (a tenth of a millisecond once a target step has evicted what they read),
    for a caller that guarantees them: the engine, whose caches and tables have that layout by construction."""
    layer = draft.layers[0]
    block, width, capacity = len(block_ids), features.shape[0], keys[0].shape[1]
    logits, tokens = torch.empty(rows, draft.vocab_size), torch.empty(rows, dtype=torch.int64)
    pointers = ctypes.c_void_p * len(keys)
    _build()[0].draft_block(ctypes.byref(draft.table), pointers(*(t.data_ptr() for t in keys)),
                            pointers(*(t.data_ptr() for t in values)), (ctypes.c_long * block)(*block_ids),
                            features.data_ptr(), draft.feature_size, width, block, layer.hidden_size, layer.heads,
                            layer.kv_heads, layer.head_dim, cos.data_ptr(), signed_sin.data_ptr(), capacity, start, eps,
                            parallel, first, rows, logits.data_ptr(),
                            vocab_ids.data_ptr() if vocab_ids is not None else None, tokens.data_ptr())
    return logits, tokens
