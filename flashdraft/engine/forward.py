"""The target's forward on the engine (`Engine`): the supported models, the weights in the engine's form (int8
on GGUF blocks, or float32), and the forward itself, each decoder layer one native call where it can."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import native, quantized
from ..files import COMPLETE_MARKER
from .cache import EngineCache, _leading
from .kernels import (
    _DRAFT_KINDS,
    _ONE_BLAS_THREAD,
    KERNEL_ROWS,
    LAYER_KINDS,
    NATIVE_PRODUCTS,
    KernelChoice,
    KernelLinear,
    _native_parallel,
    _parallel_bits,
    native_kernels,
)
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
from .settings import ARITHMETICS, CHECKED_ROWS, arithmetic_setting
from .weights import WeightForms, _aligned, _Layer, _layer_products, _layer_weights, _placeholder

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # tables that depend on the position alone

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


def _weight_storage(model: nn.Module) -> tuple:
    """Where a model's weights are (the embedding's, each layer's q and down projections'): moved, e.g. by
    `model.to(dtype)`, they are no longer what an engine made from them reads."""
    return model.get_input_embeddings().weight.data_ptr(), tuple(
        (layer.self_attn.q_proj.weight.data_ptr(), layer.mlp.down_proj.weight.data_ptr())
        for layer in model.base_model.layers)


def _foreign_hooks(module: nn.Module) -> list:
    """A module's forward hooks other than transformers' own (it records hidden states through hooks it leaves
    installed, harmless here)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [hook for hook in hooks if not getattr(hook, "__module__", "").startswith("transformers.")]


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
        self.embed = model.get_input_embeddings().weight
        self.norm = base.norm.weight
        self.rotary = RotaryTables(base.rotary_emb, self.head_dim)
        self.choice = arithmetic or arithmetic_setting()  # what was asked for; `arithmetic` what runs
        blocks_file = self._blocks_file(model, self.choice)
        if blocks_file is None:
            self.head_weight = _aligned(model.get_output_embeddings().weight)
            self.layers = [_layer_weights(layer, self._fuse, self.num_heads, self.kv_heads) for layer in base.layers]
            self.arithmetic, self.blocks = "float32", {}
        else:
            # int8 reads the GGUF blocks: the fused and aligned float32 copies (2 GB of Qwen2.5-Coder-0.5B's, and its
            # float32 weights read from disk to make them) are made only for the products that have no kernel.
            self.head_weight = model.get_output_embeddings().weight.detach()
            self.layers = [_layer_weights(layer, lambda linears: _placeholder([m.weight for m in linears]),
                                          self.num_heads, self.kv_heads, single=lambda p: _placeholder([p]))
                           for layer in base.layers]
            self.arithmetic, self.blocks = "int8", self._block_weights(model, blocks_file)
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
        self.made_from = _weight_storage(model)  # after `_fuse` and `_aligned` have moved what they move

    def _native_weight(self, weight: torch.Tensor):
        """A product's weight as the native layer reads it: its GGUF blocks (int8 arithmetic), else its exactly
        packed form, else the float32 tensor."""
        if id(weight) in self.blocks:
            return self.blocks[id(weight)]
        packed = self.forms[id(weight)].packed
        return weight if packed is None else packed

    def _blocks_file(self, model: nn.Module, choice: str) -> Path | None:
        """The GGUF blocks the products read where the engine runs int8 arithmetic, else None (float32). "auto" is
        int8 where the target comes with GGUF blocks (a registry target) and the native kernels build, else float32;
        "int8" fails, saying why, where it cannot run."""
        if choice not in ARITHMETICS:
            raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETICS)}, got {choice!r}")
        if choice == "float32":
            return None
        folder = Path(getattr(model, "name_or_path", "") or "")
        # Each token of a verification gets exactly what a one-token step gives it only on the native attention,
        # which computes every query alone: int8 needs it (torch's fused attention may round a row differently).
        fits = native_attention_fits(self.num_heads, self.kv_heads, self.head_dim)
        path = folder / quantized.BLOCKS_FILE  # kept by `models.prepare` beside a registry target
        if fits and path.is_file() and native.available():
            return path
        if choice == "int8":
            why = (f"the native kernels are unavailable ({native.unavailable_reason()})" if not native.available()
                   else "its attention does not fit the native kernel (head_dim 64 or 128)" if not fits
                   else f"{folder} holds no GGUF blocks ({quantized.BLOCKS_FILE}: registry targets have them)")
            raise ValueError(f"int8 arithmetic cannot run this target: {why}; use float32")
        return None

    def _block_weights(self, model: nn.Module, path: Path) -> dict[int, quantized.FusedBlocks]:
        """The products' GGUF blocks by id of the engine's weight (a placeholder, `_placeholder`). A product whose
        GGUF type has no int8 kernel gets its float32 weight instead, said in one line."""
        blocks = quantized.GGUFBlocks(path)
        # A prepared registry folder verifies the blocks file's checksum at every load: a sample of each weight's
        # rows then finds its order and a file of another model; any other folder's blocks are compared whole.
        marker = path.parent / COMPLETE_MARKER
        covered = marker.is_file() and quantized.BLOCKS_FILE in marker.read_text()
        sample = CHECKED_ROWS if covered else None
        llama = self.config.model_type == "llama"  # llama.cpp permutes a Llama's q and k rows
        head = model.get_output_embeddings()
        # (the engine's layer or None for the head, its kind, GGUF names, the linears, their heads)
        products: list[tuple[_Layer | None, str, list[str], list[nn.Linear], Sequence[int | None]]] = []
        for index, (module, layer) in enumerate(zip(model.base_model.layers, self.layers)):
            attention, mlp = module.self_attn, module.mlp
            sources = {"qkv": ((attention.q_proj, attention.k_proj, attention.v_proj),
                               (self.num_heads, self.kv_heads, None)),
                       "o": ((attention.o_proj,), (None,)), "gate_up": ((mlp.gate_proj, mlp.up_proj), (None, None)),
                       "down": ((mlp.down_proj,), (None,))}
            for kind, (linears, heads) in sources.items():
                names = [f"blk.{index}.{tensor}.weight" for tensor in quantized.LAYER_TENSORS[kind]]
                products.append((layer, kind, names, list(linears), heads if llama else (None,) * len(linears)))
        head_name = "output.weight" if "output.weight" in blocks.meta else "token_embd.weight"  # tied: the embedding
        products.append((None, "head", [head_name], [head], [None]))
        # A prepared registry folder keeps its weights in the kernel's layout once they are unpacked and checked, and
        # later engines read them back: 0.25 s instead of 3 s for Qwen2.5-Coder-0.5B (BENCHMARKS.md, "The panels
        # cache").
        cached = quantized.load_panels(path.parent) if covered else None

        def make(product):
            names = product[2]
            if cached is not None and all(name in cached for name in names):
                return quantized.FusedBlocks.of([cached[name] for name in names])
            return quantized.fused_blocks(blocks, names, [linear.weight for linear in product[3]], product[4], sample)

        # Unpacked and checked on every thread there is: numpy's work, which releases the GIL (Qwen2.5-Coder-0.5B's
        # engine took 3.5-4.3 s to make on two cores, 6.5-8.0 s one weight after another; the same weights).
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            made = list(pool.map(make, products))
        if covered and cached is None:
            try:
                quantized.save_panels({name: part for product, fused in zip(products, made)
                                       if not isinstance(fused, str) for name, part in zip(product[2], fused.parts)},
                                      path.parent)
            except OSError:  # a folder this user cannot write: every load unpacks the blocks, as before
                pass
        weights: dict[int, quantized.FusedBlocks] = {}
        left: list[str] = []
        for (layer, kind, _, linears, _), fused in zip(products, made):
            if not isinstance(fused, str):
                weights[id(self.head_weight if layer is None else getattr(layer, kind))] = fused
                continue
            left.append(fused)
            if layer is None:
                self.head_weight = _aligned(head.weight)
            else:
                setattr(layer, kind, self._fuse(linears) if len(linears) > 1 else _aligned(linears[0].weight))
        if left:
            print(f"int8 arithmetic: {len(left)} product(s) stay float32 ({left[0]})", file=sys.stderr)
        return weights

    def matches(self, model: nn.Module) -> bool:
        """Whether this engine still runs on `model`'s weights (not so after e.g. `model.to(dtype)`)."""
        return _weight_storage(model) == self.made_from

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
            # Past the row counts measured (a prefill's hundreds of rows) the threads always share the panels.
            parallel = product is _native_parallel or (x.shape[0] > max(KERNEL_ROWS) and torch.get_num_threads() > 1)
            return quantized.block_gemm(x, self.blocks[id(weight)], parallel=parallel)
        return product(x, weight, self.forms[id(weight)])

    def max_native_rows(self, threads: bool) -> int:
        """The most rows of a step that runs each layer as one native call, and in float32 arithmetic the most
        whose attention runs on the native kernel (with int8 arithmetic every forward's does). With int8, every step
        a verification takes."""
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
        features_only: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The n new tokens after the `cache.length` cached ones. Returns logits [b, n or logits_to_keep, V] and,
        with `layer_ids`, the concatenated outputs of those layers [b, n, k*d]. `features_only` (training's target
        features): no logits (None), and no layer after the last of `layer_ids` runs, so `cache` is left
        incomplete."""
        if features_only and not layer_ids:
            raise ValueError("features_only needs layer_ids")
        if not self.kernels.uses_numpy:
            return self._forward(input_ids, position_ids, cache, layer_ids, logits_to_keep, padding, features_only)
        with _ONE_BLAS_THREAD.limit(limits=1):
            return self._forward(input_ids, position_ids, cache, layer_ids, logits_to_keep, padding, features_only)

    def _forward(self, input_ids, position_ids, cache, layer_ids, logits_to_keep, padding, features_only):
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
        wanted = set(layer_ids or ())
        collected = []
        layer_count = max(wanted) + 1 if features_only else len(self.layers)
        threads = torch.get_num_threads() > 1
        # With int8 arithmetic every forward's attention is the native kernel's, which computes each query alone:
        # a row gets the same bits in a batch (padded, or by position), a chunked prefill or a block as alone, so
        # that batched and speculative decoding give exactly the tokens of plain decoding.
        exact = self.arithmetic == "int8" and (cache.padding is None or cache.leading_padding is not None)
        native_attention = self.native_attention and (exact or (start is not None and cache.padding is None
                                                                and n <= self.max_native_rows(threads)))
        visible = None if native_attention else self._visible(cache, batch, n, start, end, position_ids)
        first_key = cache.leading_padding if cache.padding is not None else None
        query_positions = position_ids.reshape(rows).contiguous() if start is None else None
        parallel = threads and attention_key_reads(batch, n, heads, kv_heads, end) >= PARALLEL_KEY_READS
        h = F.embedding(input_ids, self.embed).view(rows, -1)
        # Each layer one native call: one sequence, or a batch's decoding steps (a left-padded row's keys begin
        # after its padding; in int8, also each row at its own positions), every product on the native kernel.
        native_layers = (self.native_layers is not None and self.use_native_layers
                         and (start is not None or exact) and n <= self.max_native_rows(threads)
                         and (cache.padding is None or (padding is None and cache.leading_padding is not None))
                         and all(self.kernels.product(kind, rows) in NATIVE_PRODUCTS for kind in LAYER_KINDS))
        if native_layers:
            bits = _parallel_bits(self.kernels, rows, rows, parallel)
            for index, layer in enumerate(self.native_layers[:layer_count]):
                native.unchecked_decoder_layer(layer, cache.keys[index], cache.values[index], h, None,
                                               cos.view(rows, head_dim), sin.view(rows, head_dim), start or 0, eps,
                                               parallel=bits, first_key=first_key, batch=batch,
                                               positions=query_positions)
                if index in wanted:
                    collected.append(h.clone())  # h changes in place
        for index, layer in enumerate(() if native_layers else self.layers[:layer_count]):  # else op by op
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
                attended = native.unchecked_causal_attention(qk[:, :heads], keys, values, start or 0, parallel,
                                                             first_key=first_key, positions=query_positions)
            else:
                attended = self._attention(qk[:, :heads], keys[:, :, :end], values[:, :, :end], visible, batch, n)
            h = h + self._product("o", attended, layer.o)
            gate_up = self._product("gate_up", rms_norm(h, layer.post_norm, eps), layer.gate_up)
            h = h + self._product("down", swiglu(gate_up), layer.down)
            if index in wanted:
                collected.append(h)
        cache.length = max(cache.length, end) if start is None else end
        features = None
        if layer_ids:
            by_layer = dict(zip(sorted(wanted), collected))
            last = len(self.layers) - 1
            if last in by_layer:  # transformers reports the last layer's output after the final norm
                by_layer[last] = rms_norm(by_layer[last], self.norm, eps)
            features = torch.cat([by_layer[i] for i in layer_ids], dim=-1).view(batch, n, -1)
        if features_only:
            return None, features
        h = h.view(batch, n, -1)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        kept = h.shape[1]
        hidden = rms_norm(h, self.norm, eps).reshape(batch * kept, -1)
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

