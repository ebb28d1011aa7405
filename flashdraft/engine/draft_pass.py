"""A DFlash draft's inference pass on a target engine's kernels (`DraftEngine`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import native, quantized
from ..draft import DraftCache
from .forward import STATIC_ROPE_TYPES, Engine, _rope_type
from .kernels import _ONE_BLAS_THREAD, _native_parallel, _parallel_bits
from .ops import (
    NATIVE_ATTENTION_QUERIES,
    PARALLEL_KEY_READS,
    RotaryTables,
    attention_key_reads,
    native_attention_fits,
    norm_rotary,
    rms_norm,
    swiglu,
)
from .settings import EngineSettings
from .weights import WeightForms, _aligned, _concatenated, _layer_products, _layer_weights

_KEPT_WEIGHTS = "_flashdraft_draft_weights"  # a draft's pass weights, kept on the module (a plain attribute)
_KEPT_HEAD = "_flashdraft_packed_head"  # a head's weight in the draft's arithmetic, kept on the head module


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
        settings = EngineSettings.from_environment()
        self.bf16_dot = native.bf16_dot_available() and settings.draft_bf16
        # A shipped (bfloat16) draft's products go further, in 8-bit integers: its weights rounded to GGUF's Q8_0
        # form (one scale per 32), its activations to 8-bit codes per 32, on the int8 kernel the target's int8
        # arithmetic runs on (`quantized.block_gemm`: AVX-512 VNNI, AVX2 or plain C). FLASHDRAFT_DRAFT_INT8=0:
        # bfloat16 arithmetic.
        self.int8_dot = native.available() and settings.draft_int8
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
        # Kept on the draft module for the next pass of the same draft (each `generate` makes its own): its 8-bit
        # weights cost a tenth of a second to make.
        key = (made_from, self.int8_dot, self.native_attention)
        kept = getattr(draft, _KEPT_WEIGHTS, None)
        if kept is not None and kept[0] == key:
            for name, value in kept[1].items():
                setattr(self, name, value)
            return
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
        names = ("layers", "fc", "hidden_norm", "norm", "forms", "bfloat16_weights", "int8", "native_layers",
                 "_made_from")
        kept_key = (self._made_from, self.int8_dot, self.native_attention)
        object.__setattr__(draft, _KEPT_WEIGHTS, (kept_key, {name: getattr(self, name) for name in names}))

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
        kept = getattr(head, _KEPT_HEAD, None)  # on the head: the target keeps it for the next generate
        if kept is None or kept[0] != made_from:
            kept = made_from, (quantized.q8_blocks if int8 else native.pack_bfloat16)(weight.detach())
            object.__setattr__(head, _KEPT_HEAD, kept)
        return kept[1]

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

    def prepare(self, head: nn.Linear, embedding: nn.Module) -> None:
        """Make the pass's weights now (the draft's 8-bit copies, its head's, the single call's), not in the first
        round: a 0.5B target's draft takes ~0.7 s, which the first `generate` would count in its decode time."""
        self._weights()
        self._packed_head(head)
        self._whole_weights(head, embedding)

    def _whole_weights(self, head: nn.Linear, embedding: nn.Module) -> native.DraftWeights | None:
        """The weights of `block`'s single native call (made again when any of them changes), or None where the
        pass cannot run so: layers not all 8-bit, a head or an embedding of another kind."""
        self._weights()
        if (self.native_layers is None or not (self.use_native_layers and self.use_whole_pass)
                or type(embedding) is not nn.Embedding or embedding.weight.dtype != torch.float32
                or id(self.fc) not in self.int8):
            return None
        head_weight = self._packed_head(head)
        if head_weight is None or head_weight.format != "blocks":
            return None
        made_from = (self._made_from, getattr(head, _KEPT_HEAD)[0], embedding.weight.data_ptr(),
                     embedding.weight._version)
        if self._whole is None or self._whole[0] != made_from:
            self._whole = made_from, native.pack_draft(self.native_layers, self.int8[id(self.fc)], self.hidden_norm,
                                                       self.norm, head_weight, embedding.weight.detach())
        return self._whole[1]

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
        whole = self._whole_weights(head, embedding)
        if whole is None or features.shape[0] != 1:
            return None
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
        return native.unchecked_draft_block(whole, [k[0] for k in cache.keys], [v[0] for v in cache.values],
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

