"""Text in and out of a target: chat prompts to token ids, and the tokens that end a generation."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase


def encode_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], chat_template: bool = True
) -> list[int]:
    """Token ids of a chat, ready for the model to answer the last message.

    With `chat_template`, the tokenizer's own template with the assistant's generation prompt; without it, the
    message texts joined by blank lines (plain completion, e.g. HumanEval's function bodies).
    """
    if not chat_template:
        return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat template: use the raw prompt text (--no-chat-template)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes any special tokens (such as a BOS) itself.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The target's end tokens: its generation config's `eos_token_id` (one id or a list) and the tokenizer's."""
    config = getattr(model, "generation_config", None)
    configured = config.eos_token_id if config is not None else None
    ids = configured if isinstance(configured, (list, tuple)) else [configured]
    return list(dict.fromkeys(i for i in [*ids, tokenizer.eos_token_id] if i is not None))
