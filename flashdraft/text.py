"""Text in and out of a target: chat prompts to token ids, the tokens that end a generation, and generated
tokens back to text deltas.

Incremental text: tokens arrive a round at a time. Each time, the whole generated sequence is decoded again and
the new suffix is the delta, so the concatenated deltas always equal `tokenizer.decode(tokens)`: a character
split over several byte-level tokens (an emoji, most non-Latin text) decodes to U+FFFD until its last byte
arrives, so trailing U+FFFD is held back rather than sent. Re-decoding costs O(n) per round, small next to a
model forward.

Stop strings are matched on the decoded text. The text of a stop string is never sent, and neither is a tail
that could still grow into one, so a stream never shows text that a later round turns out to have ended on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

INCOMPLETE = "\ufffd"  # what decoding shows for the bytes of a character that is not complete yet


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


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The target's end tokens: its generation config's `eos_token_id` (one id or a list) and the tokenizer's."""
    config = getattr(model, "generation_config", None)
    configured = config.eos_token_id if config is not None else None
    ids = configured if isinstance(configured, (list, tuple)) else [configured]
    return tuple(dict.fromkeys(i for i in [*ids, tokenizer.eos_token_id] if i is not None))


class IncrementalText:
    """Feed the tokens of each round to `add`; call `finish` once generation ends to get the held-back tail."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.tokens: list[int] = []
        self.text = ""  # the decoded text so far
        self.sent = 0  # characters of `text` already handed out

    def add(self, tokens: Sequence[int]) -> tuple[str, bool]:
        """Take a round's tokens. Returns (the text that may be sent now, whether a stop string was reached).
        After a stop string nothing more should be added."""
        self.tokens.extend(tokens)
        # No clean-up of spaces: it rewrites earlier text ("a ," -> "a,") and would break the prefix property.
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        complete = len(self.text.rstrip(INCOMPLETE))
        stop_at = self._first_stop(complete)
        if stop_at is not None:
            return self._send(stop_at), True
        return self._send(complete - self._partial_stop(complete)), False

    def finish(self) -> str:
        """Generation ended without a stop string: everything not yet sent."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def _first_stop(self, end: int) -> int | None:
        """Where the earliest stop string starts in the unsent text before `end`. Held-back text never contains
        a stop string's start earlier than `sent` (see `_partial_stop`), so the search starts there."""
        starts = [i for s in self.stop if (i := self.text.find(s, self.sent, end)) >= 0]
        return min(starts) if starts else None

    def _partial_stop(self, end: int) -> int:
        """Length of the longest unsent tail of text[:end] that is the beginning of some stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, end - self.sent), longest, -1):
                if self.text.endswith(stop[:length], 0, end):
                    longest = length
                    break
        return longest
