"""Proposals copied from the context: the continuation of the latest earlier occurrence of the last n tokens.

Answers often repeat their context (code reusing the prompt's names, a second turn reworking the first answer, an
edited text, a small model's loops). `ContextIndex` holds the sequence so far (the prompt and every verified token)
and, for each n-gram of n = `min_ngram`..`max_ngram` tokens, where the continuation of its latest occurrence
starts. Appending a token adds the n-grams that end just before it, so an update costs O(max_ngram) per new token
and a lookup O(max_ngram), however long the context: nothing is ever rescanned.

A lookup matches the longest n first (a longer match predicts better) and copies what followed it. A continuation
that runs into the end of the sequence goes on copying its own proposals, as a repeating pattern would: after
`a b c a b`, the match of `a b` at the start proposes `c a b c ...`.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_NGRAM = 4
MIN_NGRAM = 1


class ContextIndex:
    """The sequence so far and its n-gram index (see the module docstring)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self.continues_at: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens: O(max_ngram) each."""
        for token in tokens:
            end = len(self.tokens)
            # The n-grams ending at the current last token are followed by `token` now; the latest occurrence wins.
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.continues_at[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def continuation(self, limit: int) -> tuple[list[int], int]:
        """(up to `limit` tokens that followed the latest earlier occurrence of the longest matching suffix, its
        length n); ([], 0) when no suffix of `min_ngram` or more tokens occurred before."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self.continues_at.get(tuple(self.tokens[end - n :]))
            if start is not None:
                proposals: list[int] = []
                for i in range(start, start + limit):  # past the end: the copy's own tokens, `end - start` back
                    proposals.append(self.tokens[i] if i < end else proposals[i - end])
                return proposals, n
        return [], 0
