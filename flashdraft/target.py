"""The target adapter: any transformers causal LM seen through the few operations speculative decoding needs.

Embeddings through `get_input_embeddings()`, the head through `get_output_embeddings()`, the hidden states of
chosen layers through `output_hidden_states=[indices]`, and the KV cache through transformers' `Cache` API.
All cache handling lives here: transformers 5.24+ takes the cache as `cache=` and `DynamicCache.crop` takes a
negative count of tokens to drop. On CPU, in float32, Llama-family targets run on flashdraft's own exact engine
(`flashdraft.engine`) instead of transformers' forward: the same arithmetic, several times less overhead.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from .engine import (
    ARITHMETICS,
    DraftEngine,
    Engine,
    EngineCache,
    arithmetic_setting,
    cached_kernels,
    unsupported_reason,
)
from .sampling import SamplingParams, greedy, probabilities, sample

ENGINES = ("auto", "flashdraft", "transformers")
_ENGINE_CHOICE = "_flashdraft_engine_choice"
_ARITHMETIC_CHOICE = "_flashdraft_arithmetic_choice"
_ENGINE = "_flashdraft_engine"  # the model's engine, built by `TargetModel.engine`
_KEPT_HEAD_ROWS = "_flashdraft_head_rows"  # (key, the head's rows of the last drafting vocabulary): `head_rows`
Cache = DynamicCache | EngineCache
RowKV = tuple[torch.Tensor, torch.Tensor] | DynamicCache  # one row's K/V, from `RowCache.copy_row`


class RowCache:
    """The KV caches of sequences of different lengths decoded together (`flashdraft.batching`), one row each, in
    the order of the batch's rows. On the engine, one `EngineCache` by position: a row's K/V sit at its tokens' own
    positions, so no row is padded and rolling a row back costs nothing. On transformers' forward, one
    `DynamicCache` per row, run row by row (exact, without the batch's speed)."""

    def __init__(self, engine_cache: EngineCache | None, new_cache: Callable[[], DynamicCache]):
        self.engine_cache = engine_cache
        self.new_cache = new_cache  # an empty row's cache, on transformers' forward
        self.caches: list[DynamicCache] = []  # transformers' forward only

    def __len__(self) -> int:
        return self.engine_cache.rows if self.engine_cache is not None else len(self.caches)

    def add(self, cache: Cache) -> None:
        """A sequence's own cache (its prefill, from `TargetModel.new_cache`) joins as the last row."""
        if self.engine_cache is not None:
            self.engine_cache.add_row(cache.row_kv(0, cache.length))
        else:
            self.caches.append(cache)

    def add_empty(self) -> None:
        """An empty row joins as the last row (a sequence about to be prefilled, `TargetModel.prefill_rows`)."""
        if self.engine_cache is not None:
            self.engine_cache.add_row(None)
        else:
            self.caches.append(self.new_cache())

    def add_from(self, other: RowCache, row: int, length: int) -> None:
        """Row `row` of `other`, its first `length` positions, joins as the last row (`other` keeps it until it
        is removed there)."""
        if self.engine_cache is not None:
            self.engine_cache.add_row(other.engine_cache.row_kv(row, length))
        else:
            self.caches.append(other.caches[row])

    def copy_row(self, row: int, length: int) -> RowKV:
        """A copy of row `row`'s first `length` positions, which `add_copy` adds to a row cache of the same target."""
        if self.engine_cache is not None:
            return tuple(part.clone() for part in self.engine_cache.row_kv(row, length))
        cache = copy.deepcopy(self.caches[row])
        TargetModel.rollback(cache, cache.get_seq_length() - length)
        return cache

    def add_copy(self, kept: RowKV, length: int) -> None:
        """A row holding the first `length` positions of `kept` (from `copy_row`) joins as the last row; `kept`
        stays as it was."""
        if self.engine_cache is not None:
            self.engine_cache.add_row((kept[0][:, :, :length], kept[1][:, :, :length]))
        else:
            cache = copy.deepcopy(kept)
            TargetModel.rollback(cache, cache.get_seq_length() - length)
            self.caches.append(cache)

    def remove(self, row: int) -> None:
        """Row `row` leaves the batch; the last row takes its place (as the batch's own rows must)."""
        if self.engine_cache is not None:
            self.engine_cache.remove_row(row)
        else:
            self.caches[row] = self.caches[-1]
            self.caches.pop()

    def keep(self, lengths: Sequence[int]) -> None:
        """Row r keeps its first `lengths[r]` positions (the rejected part of its verified block goes)."""
        if self.engine_cache is None:
            for cache, length in zip(self.caches, lengths):
                TargetModel.rollback(cache, cache.get_seq_length() - length)


@dataclass(eq=False)
class _Prefix:
    tokens: torch.Tensor  # [n]
    kv: RowKV
    features: torch.Tensor | None  # [1, n, k*d]


class PromptPrefixes:
    """The K/V (and features) of prompt prefixes that several prompts share (a chat template's opening, a system
    prompt, shared instructions), so that a prompt beginning with one is prefilled from where it ends
    (`flashdraft.batching`). A prefix is kept once a prompt shares at least `min_tokens` with one of the `recent`
    prompts before it; at most `max_tokens` positions are kept in all, the least recently used going first.

    A position's K/V depend only on the tokens up to it (causal attention), so any leading part of a kept prefix
    serves a prompt that shares that part; the row's logits are what a prefill in other chunks gives: the same bits
    with the engine's int8 arithmetic, equal up to float32 rounding otherwise (as any chunked or batched prefill)."""

    def __init__(self, max_tokens: int, min_tokens: int = 16, recent: int = 32):
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"the prefix cache's size must be an integer >= 0 tokens, got {max_tokens!r}")
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.kept: list[_Prefix] = []  # the most recently used last
        self.recent: deque[torch.Tensor] = deque(maxlen=recent)
        self.hits = 0  # prompt tokens served from kept prefixes

    @property
    def tokens(self) -> int:
        """Positions kept in all."""
        return sum(len(prefix.tokens) for prefix in self.kept)

    def start_row(self, prompt: torch.Tensor, cache: RowCache) -> tuple[int, torch.Tensor | None]:
        """A row for `prompt` ([P] token ids) joins `cache` as its last row, holding the longest kept prefix of the
        prompt (all but its last token at most: that one's logits are the prefill's result). Returns how many
        positions it holds and their features [1, n, k*d] (None when it holds none, or none are kept)."""
        best, length = None, 0
        for prefix in self.kept:
            shared = min(_shared_length(prefix.tokens, prompt), len(prompt) - 1)
            if shared > length:
                best, length = prefix, shared
        if best is None:
            cache.add_empty()
            return 0, None
        self.kept.remove(best)
        self.kept.append(best)
        cache.add_copy(best.kv, length)
        self.hits += length
        return length, None if best.features is None else best.features[:, :length]

    def remember(self, prompt: torch.Tensor, cache: RowCache, row: int, features: Sequence[torch.Tensor]) -> None:
        """`prompt` ([P]) is prefilled in row `row` of `cache` (`features`: its features in chunks [1, n_i, k*d]
        along the prompt, none without a draft): keep the longest prefix it shares with a recent prompt, unless a
        kept prefix already holds it. The chunks are joined only for a prefix that is kept."""
        if self.max_tokens == 0:
            return
        shared = max((_shared_length(earlier, prompt) for earlier in self.recent), default=0)
        self.recent.append(prompt)
        if shared < self.min_tokens or shared > self.max_tokens:
            return
        if any(_shared_length(prefix.tokens, prompt) >= shared for prefix in self.kept):
            return
        # A kept prefix that this one extends is no longer needed.
        self.kept = [p for p in self.kept if _shared_length(p.tokens, prompt) < len(p.tokens)]
        self.kept.append(_Prefix(prompt[:shared].clone(), cache.copy_row(row, shared),
                                 torch.cat(list(features), dim=1)[:, :shared].clone() if features else None))
        while self.tokens > self.max_tokens:
            self.kept.pop(0)


def _shared_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two 1-D token tensors share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class TargetModel:
    """A causal LM wrapped for speculative decoding: one sequence (`forward`), or several of different lengths
    together (`forward_rows`).

    `engine`: "auto" runs flashdraft's engine where it can (Llama, Qwen2 and Qwen3 in float32 on CPU,
    `flashdraft.engine.unsupported_reason`) and transformers' forward elsewhere; "flashdraft" requires the engine
    (failing with the reason when it cannot run); "transformers" always runs transformers' forward. None (the
    default): the choice `load_target(engine=...)` recorded on the model, else "auto".
    """

    def __init__(self, model: PreTrainedModel, engine: str | None = None):
        if model.get_output_embeddings() is None:
            raise ValueError(
                f"{type(model).__name__} has no output head: the target must be a causal LM "
                "(load it with AutoModelForCausalLM)"
            )
        engine = engine or getattr(model, _ENGINE_CHOICE, "auto")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        if engine == "flashdraft" and (reason := unsupported_reason(model)) is not None:
            raise ValueError(f"the flashdraft engine cannot run this target: {reason}; use engine=\"transformers\"")
        self.model = model
        self.engine_choice = engine
        self.config = model.config.get_text_config()
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()

    @property
    def engine(self) -> Engine | None:
        """The flashdraft engine this target runs on, or None for transformers' forward. Built on first use and
        kept on the model (its fused weights are the model's own, so one engine serves every wrapper), rebuilt
        when the model's weights were replaced (e.g. `.to(dtype)`); its kernels are measured once per machine."""
        if self.engine_choice == "transformers" or unsupported_reason(self.model) is not None:
            return None
        engine = getattr(self.model, _ENGINE, None)
        arithmetic = getattr(self.model, _ARITHMETIC_CHOICE, "auto")
        arithmetic = arithmetic_setting() if arithmetic == "auto" else arithmetic
        if engine is None or not engine.matches(self.model) or engine.choice != arithmetic:
            engine = Engine(self.model, arithmetic)
            if engine.arithmetic == "float32":  # int8 runs every product on the native kernels: nothing to choose
                engine.kernels = cached_kernels(engine)
            setattr(self.model, _ENGINE, engine)
        return engine

    @property
    def engine_name(self) -> str:
        """"flashdraft" or "transformers": which forward runs."""
        return "flashdraft" if self.engine is not None else "transformers"

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

    def identity(self) -> dict:
        """What tells one target from another in the settings that data and caches are keyed by: its name (or
        folder) and its shape. Record folders store it, so its keys and values must stay as they are."""
        return {
            "model": getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__,
            "num_layers": self.config.num_hidden_layers,
            "hidden_size": self.config.hidden_size,
            "vocab_size": self.config.vocab_size,
        }

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, n] token ids -> [b, n, d] input embeddings."""
        return self.embed_tokens(input_ids)

    def head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, n, d] final hidden states -> [b, n, V] logits."""
        return self.lm_head(hidden_states)

    def head_rows(self, token_ids: torch.Tensor | None) -> nn.Module:
        """The output head restricted to the rows of `token_ids` (a draft's drafting vocabulary), frozen; the whole
        head for None. A draft's logits then cost only the rows it drafts over."""
        head = self.lm_head
        if token_ids is None:
            return head
        # Kept on the model for the next generate with the same draft: made again, the rows and their packed form
        # (`DraftEngine`) cost a tenth of a second a call.
        engine = self.engine  # first: building the engine may move the head's weight
        key = (head.weight.data_ptr(), head.weight._version, token_ids.data_ptr(), token_ids._version,
               len(token_ids), engine)
        kept = getattr(self.model, _KEPT_HEAD_ROWS, None)
        if kept is not None and kept[0] == key:
            return kept[1]
        rows = nn.utils.skip_init(nn.Linear, head.in_features, len(token_ids), bias=head.bias is not None,
                                  device=head.weight.device)
        rows.weight = nn.Parameter(head.weight[token_ids].detach(), requires_grad=False)
        if head.bias is not None:
            rows.bias = nn.Parameter(head.bias[token_ids].detach(), requires_grad=False)
        rows = self.accelerate(rows)
        object.__setattr__(self.model, _KEPT_HEAD_ROWS, (key, rows))
        return rows

    def accelerate(self, module: nn.Module) -> nn.Module:
        """A draft (or a head) whose inference products run on this target's engine kernels
        (`Engine.accelerate`); unchanged when the target runs transformers' forward."""
        engine = self.engine
        if engine is None or module.parameters().__next__().dtype != torch.float32:
            return module
        return engine.accelerate(module)

    def draft_forward(self, draft: nn.Module) -> Callable[..., torch.Tensor]:
        """The draft's inference forward: its pass on this target's engine where it runs there (`DraftEngine`),
        else the module itself, its products on the engine's kernels where there is an engine."""
        return DraftEngine.for_draft(draft, self.engine) or self.accelerate(draft)

    def freeze(self) -> None:
        """No gradient for any of the target's weights (training a draft against it)."""
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)

    def new_cache(self) -> Cache:
        engine = self.engine
        return engine.new_cache() if engine is not None else DynamicCache(config=self.model.config)

    def new_row_cache(self) -> RowCache:
        """An empty `RowCache`: sequences join it empty (`add_empty`, then `prefill_rows`), from another row cache
        (`add_from`) or with their own prefilled `new_cache()` (`add`)."""
        engine = self.engine
        return RowCache(engine.new_cache(by_position=True) if engine is not None else None,
                        lambda: DynamicCache(config=self.model.config))

    @torch.no_grad()
    def forward_rows(
        self,
        input_ids: torch.Tensor,  # [b, n] one block per row
        position_ids: torch.Tensor,  # [b, n] each row's own positions
        cache: RowCache,
        layer_ids: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cached forward over every row of `cache`: logits [b, n, V] and, with `layer_ids`, features
        [b, n, k*d] (as `forward`). Row r's block follows its cached positions; what it caches past the length
        the caller then `keep`s is dropped."""
        if cache.engine_cache is not None:
            return getattr(self.model, _ENGINE).forward(input_ids, position_ids, cache.engine_cache, layer_ids)
        outputs = [self.forward(input_ids[r : r + 1], position_ids[r : r + 1], row_cache, layer_ids)
                   for r, row_cache in enumerate(cache.caches)]
        features = torch.cat([f for _, f in outputs]) if layer_ids else None
        return torch.cat([logits for logits, _ in outputs]), features

    @torch.no_grad()
    def prefill_rows(
        self,
        chunks: Sequence[torch.Tensor],  # [n_r] the next prompt tokens of each row
        starts: Sequence[int],  # the position of each chunk's first token (what the row holds already)
        cache: RowCache,
        layer_ids: list[int] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """One cached forward over a chunk of every row of `cache`, chunks of different lengths (sequences
        prefilled together). Returns the logits after each chunk's last token [b, 1, V] and, with `layer_ids`, each
        row's features [1, n_r, k*d] (as `forward`).

        On the engine, one forward over [b, widest chunk], each chunk placed at the end of its row so that the
        last column holds every row's last token (only its logits are computed); the padding before it takes the
        positions right after the chunk, which the row's real tokens never see (a query sees the positions up to
        its own) and its next tokens overwrite. On transformers' forward, row by row."""
        device = self.device
        if cache.engine_cache is None:
            outputs = [self.forward(chunk[None], torch.arange(start, start + len(chunk), device=device)[None],
                                    row_cache, layer_ids, logits_to_keep=1)
                       for chunk, start, row_cache in zip(chunks, starts, cache.caches)]
            return torch.cat([logits for logits, _ in outputs]), [f for _, f in outputs] if layer_ids else None
        width = max(len(chunk) for chunk in chunks)
        input_ids = torch.zeros(len(chunks), width, dtype=torch.long, device=device)
        positions = torch.empty(len(chunks), width, dtype=torch.long, device=device)
        offsets = torch.arange(width, device=device)
        for r, (chunk, start) in enumerate(zip(chunks, starts)):
            pad = width - len(chunk)
            input_ids[r, pad:] = chunk
            input_ids[r, :pad] = chunk[-1]  # any token: never seen
            positions[r, pad:] = start + offsets[: len(chunk)]
            positions[r, :pad] = start + len(chunk) + offsets[:pad]
        logits, features = getattr(self.model, _ENGINE).forward(input_ids, positions, cache.engine_cache, layer_ids,
                                                                 logits_to_keep=1)
        if features is None:
            return logits, None
        return logits, [features[r : r + 1, width - len(chunk) :] for r, chunk in enumerate(chunks)]

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [1, n]
        position_ids: torch.Tensor,  # [1, n]
        cache: Cache,
        layer_ids: list[int] | None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cached forward. Returns logits [1, n or logits_to_keep, V] and, when `layer_ids` is given, the
        concatenated hidden states of those layers [1, n, k*d] (layer i is hidden_states[i + 1])."""
        if isinstance(cache, EngineCache):  # made by the model's engine: no checks per round (they cost ~0.5 ms)
            return getattr(self.model, _ENGINE).forward(input_ids, position_ids, cache, layer_ids, logits_to_keep)
        selected = hidden_state_indices(layer_ids) if layer_ids else False
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

    @torch.no_grad()
    def padded_hidden_states(
        self, sequences: Sequence[Sequence[int] | torch.Tensor], layer_ids: Sequence[int] | None, pad_token_id: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One right-padded forward over token sequences, no cache. Returns the concatenated hidden states of
        `layer_ids` [b, W, k*d] (without layer ids: the final hidden states, before the head, [b, W, d]) and the
        attention mask [b, W]. Right padding keeps each sequence at positions 0..len-1, unaffected by the pads
        after it.

        With layer ids on the engine, each sequence runs alone (no padding), as a prompt's prefill does: with the
        int8 arithmetic these are, bit for bit, the features decoding gives the draft, and a training step's
        features cost about half of transformers' bfloat16 forward on a CPU (`flashdraft train --dtype float32`)."""
        device = self.device
        width = max(len(ids) for ids in sequences)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
        for row, ids in enumerate(sequences):
            attention_mask[row, : len(ids)] = 1
        if layer_ids and self.engine is not None:
            return self._engine_hidden_states(sequences, list(layer_ids), width), attention_mask
        input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long, device=device)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.as_tensor(ids, device=device)
        if not layer_ids:
            hidden = self.model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return hidden, attention_mask
        selected = hidden_state_indices(layer_ids)
        output = self.model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=selected, use_cache=False,
            logits_to_keep=1,
        )
        return torch.cat([output.hidden_states[i] for i in selected], dim=-1), attention_mask

    def _engine_hidden_states(self, sequences, layer_ids: list[int], width: int) -> torch.Tensor:
        """`padded_hidden_states`'s features on the engine: each sequence alone, in a cache of its own."""
        device, features = self.device, None
        for row, ids in enumerate(sequences):
            ids = torch.as_tensor(ids, device=device)
            # The layers after the last feature layer and the head are not needed (a twelfth of Qwen 0.5B's).
            _, hidden = self.engine.forward(ids[None], torch.arange(len(ids), device=device)[None], self.new_cache(),
                                            layer_ids, features_only=True)
            if features is None:
                features = hidden.new_zeros(len(sequences), width, hidden.shape[-1])
            features[row, : len(ids)] = hidden[0]
        return features

    @staticmethod
    def rollback(cache: Cache, num_tokens: int) -> None:
        """Drop the last `num_tokens` positions of `cache` (the rejected part of a verified block)."""
        if num_tokens > 0:
            cache.crop(-num_tokens)

    @torch.no_grad()
    def generate_batch(
        self,
        prompt_ids: Sequence[list[int]],
        max_new_tokens: int,
        stop_ids: Sequence[int],
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        pad_token_id: int = 0,
        on_logits: Callable[[list[int], torch.Tensor], None] | None = None,
    ) -> list[list[int]]:
        """Decode several prompts together: left-padded, one prefill, then one token per step with a KV cache; a
        row that emits a stop token leaves the batch at once (its cache rows go too). Greedy at temperature 0 (each
        row what `generate` gives it alone: exactly with the engine's int8 arithmetic, else but for near-ties that
        padding can flip), else a draw from softmax(logits / T) with `generator`. `on_logits(rows, logits)` sees
        every step's [b_live, V] logits with the prompt index of each row, before the tokens are picked. Returns
        each prompt's new token ids (a stop token included when one ended it)."""
        device = self.device
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((len(prompt_ids), width), dtype=torch.long, device=device)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, device=device)
            attention_mask[row, width - len(ids) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [b, width]: pads sit at position 0
        next_position = attention_mask.sum(-1)  # [b] position of each row's next token
        rows = torch.arange(len(prompt_ids), device=device)  # prompt index of each row still decoding
        stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
        responses: list[list[int]] = [[] for _ in prompt_ids]

        cache = self.new_cache()
        engine = self.engine
        if engine is not None:
            logits = engine.forward(input_ids, position_ids, cache, logits_to_keep=1,
                                    padding=attention_mask == 0)[0][:, -1]
        else:
            logits = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=True, logits_to_keep=1,
            ).logits[:, -1]  # [b, V]
        for step in range(max_new_tokens):
            live_rows = rows.tolist()
            if on_logits is not None:
                on_logits(live_rows, logits)
            tokens = _pick_tokens(logits, temperature, generator)  # [b_live]
            for row, token in zip(live_rows, tokens.tolist()):
                responses[row].append(token)
            keep = ~torch.isin(tokens, stop)
            if step == max_new_tokens - 1 or not keep.any():
                break
            if not keep.all():  # finished rows leave the batch: their cache rows go too
                kept = keep.nonzero().squeeze(-1)
                if engine is not None:
                    cache.select_rows(kept)
                else:
                    cache.batch_select_indices(kept)
                rows, tokens, attention_mask, next_position = (
                    rows[kept], tokens[kept], attention_mask[kept], next_position[kept],
                )
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=-1)
            if engine is not None:
                logits = engine.forward(tokens[:, None], next_position[:, None], cache)[0][:, -1]
            else:
                logits = self.model(
                    input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_position[:, None],
                    cache=cache, use_cache=True,
                ).logits[:, -1]
            next_position = next_position + 1
        return responses


def remember_engine(model: PreTrainedModel, engine: str, arithmetic: str = "auto") -> None:
    """Make `engine` and its `arithmetic` (`flashdraft.engine.ARITHMETICS`; "auto": FLASHDRAFT_ARITHMETIC's, by
    default int8 where the target has GGUF blocks) the default of every `TargetModel` of `model` (the command
    line's --engine and --arithmetic, whichever module wraps the model later)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETICS)}, got {arithmetic!r}")
    setattr(model, _ENGINE_CHOICE, engine)
    setattr(model, _ARITHMETIC_CHOICE, arithmetic)


def hidden_state_indices(layer_ids: Sequence[int]) -> list[int]:
    """transformers' `hidden_states[0]` is the embedding output: target layer i is `hidden_states[i + 1]`."""
    return [i + 1 for i in layer_ids]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so that a clock around it times the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pick_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[b, V] logits -> [b] next tokens: argmax at temperature 0, else a draw from softmax(logits / T) with the
    decoding loop's own sampler, on the generator's device."""
    if temperature == 0:
        return greedy(logits)
    probs = probabilities(logits, SamplingParams(temperature))
    return sample(probs.to(generator.device if generator is not None else "cpu"), generator).to(logits.device)
