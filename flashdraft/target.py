"""The target adapter: any transformers causal LM seen through the few operations speculative decoding needs.

Embeddings through `get_input_embeddings()`, the head through `get_output_embeddings()`, the hidden states of
chosen layers through `output_hidden_states=[indices]`, and the KV cache through transformers' `Cache` API.
All cache handling lives here: transformers 5.24+ takes the cache as `cache=` and `DynamicCache.crop` takes a
negative count of tokens to drop.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class TargetModel:
    """A causal LM wrapped for speculative decoding (batch size 1)."""

    def __init__(self, model: PreTrainedModel):
        if model.get_output_embeddings() is None:
            raise ValueError(
                f"{type(model).__name__} has no output head: the target must be a causal LM "
                "(load it with AutoModelForCausalLM)"
            )
        self.model = model
        self.config = model.config.get_text_config()
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, n] token ids -> [b, n, d] input embeddings."""
        return self.embed_tokens(input_ids)

    def head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, n, d] final hidden states -> [b, n, V] logits."""
        return self.lm_head(hidden_states)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        position_ids: torch.Tensor,  # [1, n]
        cache: DynamicCache,
        layer_ids: list[int] | None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cached forward. Returns logits [1, n or logits_to_keep, V] and, when `layer_ids` is given, the
        concatenated hidden states of those layers [1, n, k*d] (layer i is hidden_states[i + 1])."""
        selected = [i + 1 for i in layer_ids] if layer_ids else False
        output = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            output_hidden_states=selected,
            logits_to_keep=logits_to_keep,
        )
        features = None
        if selected:
            features = torch.cat([output.hidden_states[i] for i in selected], dim=-1)
        return output.logits, features

    @staticmethod
    def rollback(cache: DynamicCache, num_tokens: int) -> None:
        """Drop the last `num_tokens` positions of `cache` (the rejected part of a verified block)."""
        if num_tokens > 0:
            cache.crop(-num_tokens)
