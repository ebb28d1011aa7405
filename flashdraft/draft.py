"""The DFlash draft network: KV-injection attention, its decoder layers, and `DFlashDraftModel`.

The draft proposes a whole block of tokens in one non-causal forward pass. Its queries come from the block
only (the anchor token followed by mask tokens, embedded with the target's own embedding table); its keys
and values are the same projections applied to [context features ; block], where the context features are
the target's hidden states, projected once by `fc` + `hidden_norm` (SPEC section 1, seeds/000).

The checkpoint is a Qwen3-shaped Hugging Face folder (SPEC section 2): `architectures: ["DFlashDraftModel"]`,
`model_type: "qwen3"`, `block_size`, `num_target_layers` and `dflash_config: {mask_token_id,
target_layer_ids}`; weights named `layers.{i}...`, `norm`, `fc`, `hidden_norm`. There is no embedding table
and no lm_head: the target's are used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Qwen3Config
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .files import check_finite
from .rules import check_block_size

DRAFT_ARCHITECTURE = "DFlashDraftModel"
# The largest block a draft may declare: one round drafts and verifies this many tokens, so a config with a block
# of 100,000 would allocate and compute for minutes before its first token.
MAX_BLOCK_SIZE = 256


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a draft reads by default (SPEC section 1).

    One draft layer reads the middle target layer; otherwise `num_draft_layers` ids spread evenly with
    round() from layer 1 to layer T-3 (Qwen3-8B, T=36, N=5: [1, 9, 17, 25, 33]).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    span = last - first
    return [round(first + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# Queries attended together when a boolean mask hides most keys from most queries (training: one forward over many
# blocks, each seeing the context before its anchor and its own block): each group of this many queries attends only
# to the keys some query of the group sees, which does the same sums over far fewer keys (about half the attention
# time at the recipe's 128 blocks of 8 over contexts of 400-900 positions, BENCHMARKS.md).
QUERY_GROUP = 128


def attend_in_query_groups(attention, module, query, key, value, mask: torch.Tensor, **kwargs):
    """`attention` (a transformers attention function) over groups of `QUERY_GROUP` queries, each with the keys its
    queries' rows of the boolean `mask` [b, 1, q, k] reach: the same result (masked keys weigh exactly zero), with
    the same [b, q, h, dh] output."""
    outputs = []
    for start in range(0, query.shape[2], QUERY_GROUP):
        rows = mask[:, :, start : start + QUERY_GROUP]
        seen = rows.any(dim=2).any(dim=0)[0].nonzero().squeeze(1)  # key columns some query of the group sees
        output, _ = attention(module, query[:, :, start : start + QUERY_GROUP], key.index_select(2, seen),
                              value.index_select(2, seen), rows.index_select(3, seen), **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


def apply_window_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE over a window of keys where the queries are the window's last positions.

    query [b, h, q, dh], key [b, hk, k, dh], cos/sin [b, k, dh] for every key position: each key sits at its
    true absolute position and the queries take the last q of them (the block).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = query.shape[-2]
    query = query * cos[..., -q_len:, :] + rotate_half(query) * sin[..., -q_len:, :]
    key = key * cos + rotate_half(key) * sin
    return query, key


class DFlashAttention(nn.Module):
    """KV-injection attention: block queries attend, non-causally, to [context ; block] keys and values."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False  # every block position sees the whole context and the whole block
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

    def forward(
        self,
        hidden_states: torch.Tensor,  # [b, q, d] the block
        context: torch.Tensor,  # [b, c, d] projected target features of the new context positions
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # cos, sin [b, c + q, dh]
        attention_mask: torch.Tensor | None,  # bool [b, 1, q, cached + c + q] or None
        cache: Cache | None,
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        window = torch.cat([context, hidden_states], dim=1)  # [b, c + q, d]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(window).view(batch, window.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(window).view(batch, window.shape[1], -1, self.head_dim).transpose(1, 2)
        query, key = apply_window_rotary(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        kwargs = {"dropout": self.attention_dropout if self.training else 0.0, "scaling": self.scaling,
                  "sliding_window": self.sliding_window, "is_causal": False}
        if attention_mask is not None and attention_mask.dtype == torch.bool and q_len > QUERY_GROUP:
            output, _ = attend_in_query_groups(attention, self, query, key, value, attention_mask, **kwargs)
        else:
            output, _ = attention(self, query, key, value, attention_mask, **kwargs)
        return self.o_proj(output.reshape(batch, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm transformer layer whose attention is `DFlashAttention`; the context is not normed here
    (it was normed once by `hidden_norm`) and produces no output of its own."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask, cache):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DraftCache:
    """The draft's KV cache: preallocated per layer, so appending a round's keys and dropping the block again
    are bookkeeping on a length, never a copy of the whole context (gpt-fast style). Holds batch size 1..b
    and at most `max_length` positions. Same `update` / `get_seq_length` / `crop` surface as transformers'
    caches, so the attention code takes either."""

    def __init__(self, config: Qwen3Config, max_length: int, batch_size: int = 1, device=None, dtype=None):
        shape = (batch_size, config.num_key_value_heads, max_length, config.head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.length = 0  # positions filled in every layer
        self.max_length = max_length

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append key/value [b, hk, n, dh] to layer `layer_idx`; return that layer's keys/values so far."""
        end = self._room(key.shape[-2])
        self.keys[layer_idx][:, :, self.length : end] = key
        self.values[layer_idx][:, :, self.length : end] = value
        if layer_idx == len(self.keys) - 1:
            self.length = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def claim(self, count: int) -> int:
        """Extend every layer by `count` positions at once, for a pass that writes their keys and values in place
        (the CPU engine's native draft layers); returns the first."""
        start = self.length
        self.length = self._room(count)
        return start

    def _room(self, count: int) -> int:
        end = self.length + count
        if end > self.max_length:
            raise ValueError(f"draft cache holds {self.max_length} positions, {end} were asked for")
        return end

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, num_tokens: int) -> None:
        """Drop the last -num_tokens positions (transformers' negative-count convention)."""
        self.length = max(0, self.length + num_tokens) if num_tokens < 0 else self.length


class RowDraftCache:
    """The draft's context K/V for sequences of different lengths drafted together (`flashdraft.batching`): row r
    holds its verified context at columns 0..lengths[r]-1, which are its positions. A pass over some rows writes
    each row's [new context, padded to the pass's widest ; block] right after its context (`begin_pass`), and its
    block queries see that row's context, its new context and its block, never the padding, another row or what an
    earlier pass left past its length; `end_pass` keeps the new context and drops the rest, so rollback is again a
    length. Rows join empty and leave as the batch's rows do (the last one takes the leaver's place)."""

    def __init__(self, config: Qwen3Config, device=None, dtype=None):
        if "sliding_attention" in config.layer_types and config.sliding_window is not None:
            raise ValueError("a draft with sliding-window layers drafts one sequence at a time: decode the prompts "
                             "one by one (flashdraft.generate with a single prompt), or use a full-attention draft")
        self.shape = (config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        self.device, self.dtype = device, dtype
        self.keys: torch.Tensor | None = None  # [layers, rows allocated, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.lengths: list[int] = []  # verified context positions per row
        self._pass: tuple[torch.Tensor, torch.Tensor, int] | None = None  # rows [b', 1], columns [b', w], end

    def add_row(self) -> None:
        self.lengths.append(0)

    def remove_row(self, row: int) -> None:
        last = len(self.lengths) - 1
        length = self.lengths[last]
        # A row that never drafted holds nothing, and may lie past the rows allocated (they grow in passes).
        if row != last and length:
            self.keys[:, row, :, :length] = self.keys[:, last, :, :length]
            self.values[:, row, :, :length] = self.values[:, last, :, :length]
        self.lengths[row] = self.lengths[last]
        self.lengths.pop()

    def _reserve(self, rows: int, length: int) -> None:
        allocated, capacity = (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])
        if rows <= allocated and length <= capacity:
            return
        new_rows, new_capacity = max(allocated, 1), max(capacity, 256)
        while new_rows < rows:
            new_rows *= 2
        while new_capacity < length:
            new_capacity *= 2
        layers, kv_heads, head_dim = self.shape
        keys = torch.zeros(layers, new_rows, kv_heads, new_capacity, head_dim, device=self.device, dtype=self.dtype)
        values = torch.zeros_like(keys)
        if self.keys is not None:
            keys[:, :allocated, :, :capacity] = self.keys
            values[:, :allocated, :, :capacity] = self.values
        self.keys, self.values = keys, values

    def begin_pass(self, rows: list[int], widths: list[int], block_size: int) -> torch.Tensor:
        """Place a pass over `rows` whose new contexts have `widths` positions (padded to the widest, then the
        block). Returns its attention mask, bool [b', 1, block_size, end], True = visible."""
        width = max(widths)
        starts = torch.tensor([self.lengths[r] for r in rows], device=self.device)[:, None]  # [b', 1]
        end = int(starts.max()) + width + block_size
        self._reserve(len(self.lengths), end)
        columns = starts + torch.arange(width + block_size, device=self.device)  # [b', w]
        self._pass = torch.tensor(rows, device=self.device)[:, None], columns, end
        keys = torch.arange(end, device=self.device)[None, :]  # [1, end]
        context_end = starts + torch.tensor(widths, device=self.device)[:, None]
        block_start = starts + width
        visible = (keys < context_end) | ((keys >= block_start) & (keys < block_start + block_size))  # [b', end]
        return visible[:, None, None, :].expand(-1, 1, block_size, -1)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's key/value [b', hk, w, dh] at each row's columns; return the rows' keys/values so far."""
        rows, columns, end = self._pass
        self.keys[layer_idx].transpose(1, 2)[rows, columns] = key.transpose(1, 2)
        self.values[layer_idx].transpose(1, 2)[rows, columns] = value.transpose(1, 2)
        return self.keys[layer_idx][rows[:, 0], :, :end], self.values[layer_idx][rows[:, 0], :, :end]

    def end_pass(self, rows: list[int], widths: list[int]) -> None:
        """The new contexts stay; the padding and the block go."""
        for row, width in zip(rows, widths):
            self.lengths[row] += width
        self._pass = None


class DFlashDraftModel(PreTrainedModel):
    """A DFlash block-diffusion draft model (SPEC sections 1-2)."""

    config_class = Qwen3Config
    base_model_prefix = ""
    main_input_name = "noise_embedding"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        validate_draft_config(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        num_features = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        # Optional reduced drafting vocabulary: the sorted target token ids the draft proposes from. It lives in
        # the config, not the weights, because vLLM refuses weights it has no parameter for; readers that ignore
        # it still decode correctly, drafting over the full vocabulary instead.
        ids = config.dflash_config.get("draft_vocab_ids")
        ids = torch.tensor(ids, dtype=torch.long) if ids else None
        self.register_buffer("draft_vocab_ids", ids, persistent=False)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.dflash_config["mask_token_id"]

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.dflash_config["target_layer_ids"])

    def set_draft_vocab(self, token_ids: torch.Tensor | list[int] | None) -> None:
        """Draft over these target token ids only (None: the full vocabulary). Saved with the checkpoint."""
        if token_ids is None:
            self.draft_vocab_ids = None
            self.config.dflash_config.pop("draft_vocab_size", None)
            self.config.dflash_config.pop("draft_vocab_ids", None)
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be non-empty and within [0, {self.config.vocab_size})")
        self.draft_vocab_ids = ids.to(self.fc.weight.device)
        self.config.dflash_config["draft_vocab_size"] = ids.numel()
        self.config.dflash_config["draft_vocab_ids"] = ids.tolist()

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[b, c, k*d] concatenated target features -> [b, c, d] context signal shared by all layers."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embedding: torch.Tensor,  # [b, q, d] block tokens embedded by the target
        target_hidden: torch.Tensor,  # [b, c, k*d] raw target features of the new context positions
        position_ids: torch.Tensor,  # [b, c + q] positions of the new context keys, then of the block
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,  # bool [b, 1, q, cached + c + q], True = visible
    ) -> torch.Tensor:
        context = self.project_context(target_hidden)
        position_embeddings = self.rotary_emb(noise_embedding, position_ids)
        # A caller's mask (training: one forward over many blocks) applies to every layer, cut to the window in
        # sliding layers; without one, only sliding layers need a mask.
        sliding_mask = self._sliding_window_mask(position_ids, noise_embedding.shape[1], cache)
        if attention_mask is not None:
            sliding_mask = attention_mask if sliding_mask is None else attention_mask & sliding_mask
        attention_mask, sliding_mask = self._for_kernel(attention_mask), self._for_kernel(sliding_mask)
        hidden_states = noise_embedding
        for layer in self.layers:
            mask = sliding_mask if layer.self_attn.sliding_window is not None else attention_mask
            hidden_states = layer(hidden_states, context, position_embeddings, mask, cache)
        return self.norm(hidden_states)

    def _for_kernel(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """Boolean masks (True = visible) suit sdpa and flex; the eager kernel adds its mask to the scores, so it
        gets 0 where visible and the dtype's minimum elsewhere."""
        if mask is None or mask.dtype != torch.bool or self.config._attn_implementation != "eager":
            return mask
        blocked = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        return blocked.masked_fill_(~mask, torch.finfo(self.dtype).min)

    def _sliding_window_mask(self, position_ids, q_len, cache) -> torch.Tensor | None:
        """For sliding layers: a block query at position p sees context keys at k with p - k < window, and the
        whole block. Only built when some layer slides and the window can actually cut something off."""
        window = self.config.sliding_window
        if window is None or "sliding_attention" not in self.config.layer_types:
            return None
        cached = cache.get_seq_length() if cache is not None else 0
        if cached + position_ids.shape[1] <= window:
            return None
        # Cached keys are the contiguous positions 0..cached-1 (the decoding loop only caches verified context);
        # in training there is no cache and the keys are exactly `position_ids`.
        key_positions = torch.cat(
            [torch.arange(cached, device=position_ids.device).expand(position_ids.shape[0], -1), position_ids], 1
        )
        query_positions = position_ids[:, -q_len:]
        mask = query_positions[:, :, None] - key_positions[:, None, :] < window  # [b, q, keys]
        mask[:, :, -q_len:] = True
        return mask[:, None]

    # ---------------------------------------------------------------- construction and checkpoints

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        *,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
        attn_implementation: str = "sdpa",
    ) -> DFlashDraftModel:
        """A fresh, randomly initialised draft shaped for `target_config` (hidden size, heads, RoPE, vocab)."""
        target_config = target_config.get_text_config()
        num_target_layers = target_config.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
        heads = target_config.num_attention_heads
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
        rope_parameters = getattr(target_config, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": getattr(target_config, "rope_theta", 10000.0),
        }
        config = Qwen3Config(
            vocab_size=target_config.vocab_size,
            hidden_size=target_config.hidden_size,
            intermediate_size=intermediate_size or target_config.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_act=getattr(target_config, "hidden_act", "silu"),
            max_position_embeddings=target_config.max_position_embeddings,
            rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope_parameters),
            tie_word_embeddings=False,
            architectures=[DRAFT_ARCHITECTURE],
            block_size=block_size,
            num_target_layers=num_target_layers,
            dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        )
        config._attn_implementation = attn_implementation
        return cls(config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> DFlashDraftModel:
        """Load a DFlash draft folder (or hub id). Local folders are checked first so that a wrong folder gets
        an error naming the problem rather than a silently half-initialised model."""
        path = Path(pretrained_model_name_or_path)
        if path.is_dir():
            check_draft_folder(path)
        kwargs.setdefault("attn_implementation", "sdpa")
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        # Non-persistent buffers are not loaded, and transformers builds them on an empty device: refill.
        model.set_draft_vocab(model.config.dflash_config.get("draft_vocab_ids"))
        check_finite(model, f"draft {pretrained_model_name_or_path}", "restore the draft folder or train it again")
        return model

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        self.config.architectures = [DRAFT_ARCHITECTURE]
        super().save_pretrained(save_directory, *args, **kwargs)
        # Serving engines and older readers take RoPE from the flat `rope_theta` key; transformers 5 writes
        # only `rope_parameters`. Write both so every reader sees the same frequencies.
        config_file = Path(save_directory) / "config.json"
        raw = json.loads(config_file.read_text())
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" in rope:
            raw["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default":
                raw["rope_scaling"] = rope
            config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def validate_draft_config(config: PretrainedConfig) -> None:
    """Raise a ValueError naming what is missing when `config` is not a DFlash draft config."""
    dflash = getattr(config, "dflash_config", None)
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
        raise ValueError(
            "not a DFlash draft config: it needs `dflash_config: {\"mask_token_id\": ..., \"target_layer_ids\": [...]}`"
        )
    for key in ("block_size", "num_target_layers"):
        if not isinstance(getattr(config, key, None), int):
            raise ValueError(f"not a DFlash draft config: missing integer field `{key}`")
    check_block_size(config.block_size, maximum=MAX_BLOCK_SIZE, what="draft block_size",
                     hint=": every round drafts and verifies that many tokens (published drafts use 8 or 16)")
    if not dflash["target_layer_ids"]:
        raise ValueError("draft dflash_config.target_layer_ids is empty: the draft must read at least one target layer")


def expected_weight_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every weight name of the checkpoint format (SPEC section 2) with its shape."""
    d, dh = config.hidden_size, config.head_dim
    q, kv, ff = config.num_attention_heads * dh, config.num_key_value_heads * dh, config.intermediate_size
    shapes = {
        "fc.weight": (d, len(config.dflash_config["target_layer_ids"]) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (dh,),
            p + "self_attn.k_norm.weight": (dh,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return shapes


def check_draft_folder(folder: Path) -> None:
    """Check a draft folder's config and the names and shapes of its safetensors weights."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a draft folder: it has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is damaged (not valid JSON: {error}): restore the draft folder or train "
                         "it again") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} is damaged (not a JSON object): restore the draft folder or train it again")
    if DRAFT_ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(
            f"{config_file} is not a DFlash draft: architectures is {raw.get('architectures')}, "
            f"expected [\"{DRAFT_ARCHITECTURE}\"]"
        )
    config = Qwen3Config.from_pretrained(folder)
    validate_draft_config(config)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    found: dict[str, tuple[int, ...]] = {}
    for weight_file in weight_files:
        found |= read_weight_shapes(weight_file, "restore the draft folder or train it again")
    expected = expected_weight_shapes(config)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"draft checkpoint {folder} is missing weights: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(
            f"draft checkpoint {folder} holds weights its config does not describe: {', '.join(extra[:8])}"
            + (f" and {len(extra) - 8} more" if len(extra) > 8 else "")
            + f" (the config says {config.num_hidden_layers} layers): the config and the weights do not belong together"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(
                f"draft checkpoint {folder}: weight {name} has shape {list(found[name])}, "
                f"the config implies {list(shape)}"
            )


def read_weight_shapes(weight_file: Path, remedy: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a safetensors file, read from its header; a damaged file is named with `remedy`."""
    size = weight_file.stat().st_size
    try:
        with safe_open(os.fspath(weight_file), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as error:  # safetensors raises its own error type for a bad header
        raise ValueError(f"{weight_file} is damaged ({size} bytes, unreadable: {error}): {remedy}") from None
    return shapes

