"""Tiny randomly initialised targets, drafts, tokenizers and a test-only oracle proposer, shared by the tests."""

from __future__ import annotations

import random
from contextlib import contextmanager

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flashdraft import DFlashDraftModel
from flashdraft.proposals import draft_tokens

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def tiny_target(
    arch: str = "llama",
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    forbid_token: int | None = None,
):
    """A random causal LM of the given architecture in float32 eval mode.

    `forbid_token` gets -inf logits, so the target itself can never produce it (used for the mask token: if it
    shows up in an output, the decoding loop leaked it)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden_size // heads, **common))
    else:
        raise ValueError(arch)
    # Random init gives nearly uniform logits; sharpen them so greedy choices are far from ties.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    if forbid_token is not None:
        model.get_output_embeddings().register_forward_hook(_forbid(forbid_token))
    return model.float().eval()


def _forbid(token: int):
    def hook(module, inputs, output):
        output[..., token] = float("-inf")
        return output

    return hook


def tiny_draft(target, *, num_layers: int = 2, block_size: int = 8, mask_token_id: int = 1, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return DFlashDraftModel.for_target(
        target.config, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id, **kw
    ).eval()


def greedy_reference(target, prompt: list[int], max_new_tokens: int, stop_token_ids=None) -> list[int]:
    """The target's own greedy continuation through `generate`."""
    if max_new_tokens == 0:
        return []
    output = target.generate(
        torch.tensor([prompt], device=target.device),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop_token_ids) if stop_token_ids else None,
        pad_token_id=0,
    )
    return output[0, len(prompt) :].tolist()


class OracleProposer:
    """Test-only proposer that knows the target's greedy continuation and errs at chosen positions.

    `continuation[i]` is the token at absolute position prompt_length + i; `wrong_at` is a set of absolute
    positions whose proposal is replaced by a different token, forcing a rejection exactly there.
    """

    target_layer_ids = None

    def __init__(self, prompt_length: int, continuation: list[int], vocab_size: int, wrong_at=frozenset()):
        self.prompt_length = prompt_length
        self.continuation = continuation
        self.vocab_size = vocab_size
        self.wrong_at = set(wrong_at)
        self.calls = []
        self.proposed = False  # whether a round's proposals await `observe`

    def begin(self, max_positions: int) -> None:
        self.calls.clear()
        self.proposed = False

    def propose(self, anchor, context, start, block_size, size, params, generator):
        """One-hot logits over the whole block, of which the first `size - 1` rows go through the shared step."""
        self.calls.append((start, block_size))
        self.proposed = True
        logits = torch.zeros(block_size - 1, self.vocab_size, device=anchor.device)
        for i in range(block_size - 1):
            position = start + 1 + i
            index = position - self.prompt_length
            token = self.continuation[index] if index < len(self.continuation) else 0
            if position in self.wrong_at:
                token = (token + 1) % self.vocab_size
            logits[i, token] = 10.0
        return draft_tokens(logits[: size - 1], None, params, generator, self.vocab_size)

    def observe(self, tokens):
        """Sources of the accepted proposals: every accepted token of a round it proposed in."""
        proposed, self.proposed = self.proposed, False
        return ["oracle"] * (len(tokens) - 1) if proposed else []


def random_case(rng: random.Random) -> tuple[list[int], int, int]:
    """A random greedy case of the core tests: (prompt of 1-64 ids in 2..95, max_new_tokens, block size 1-16)."""
    prompt = [rng.randrange(2, 96) for _ in range(rng.randint(1, 64))]
    max_new = rng.choice([0, 1, 2, rng.randint(3, 64), 64])
    return prompt, max_new, rng.randint(1, 16)


def chosen_rejections(rng: random.Random, prompt_length: int, max_new: int) -> set[int]:
    """Absolute positions where an oracle errs: none, a few, many or all, drawn at random."""
    error_rate = rng.choice([0.0, 0.05, 0.3, 1.0])
    return {prompt_length + i for i in range(max_new + 16) if rng.random() < error_rate}


def tiny_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    """An offline word-level tokenizer over words w0..w{n}, with a chat template and an end-of-turn token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<mask>", "<eot>", "<user>", "<assistant>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eot>", mask_token="<mask>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' <eot> ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
    )
    return tokenizer


@contextmanager
def serve_in_thread(app, *, timeout: float = 60.0):
    """Run an ASGI app with uvicorn in a daemon thread on a free loopback port; yields its (host, port)."""
    import socket
    import threading
    import time

    import uvicorn

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield listening.getsockname()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
