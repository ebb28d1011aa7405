"""Training prompts: the `Prompt` record, prompt files (JSONL) and a seeded mix of several prompt sources.

A prompt file holds one JSON object per line, either a chat or a plain prompt:

    {"messages": [{"role": "user", "content": "..."}, ...], "id": "optional", "response": "optional"}
    {"prompt": "...", "id": "optional", "response": "optional"}

An optional "source" field names where a prompt came from (files written by `write_prompt_file` keep it).

A chat whose last message is the assistant's keeps that message as the prompt's `response` (existing text that
`flashdraft.train.labels` can label with the target); regeneration ignores it and lets the target answer.
"""

from __future__ import annotations

import json
import logging
import random
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..files import write_atomic
from ..text import encode_chat

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
PROMPTS_FILE = "prompts.jsonl"  # a work folder's prompt set
PROMPT_SETTINGS = "prompts.json"  # a work folder holds the data of one prompt set: the one these settings make


@dataclass(frozen=True)
class Prompt:
    """One training prompt: chat messages ending with a user turn, and optionally an existing response."""

    id: str  # unique within a prompt set; regeneration and labelling resume by it
    source: str  # where it came from: a built-in source name or "file"
    messages: tuple[dict[str, str], ...]  # {"role": ..., "content": ...}, the last one from the user
    response: str | None = None  # an existing assistant answer, if the data has one

    @property
    def text(self) -> str:
        """All message contents, for length estimates and overlap checks."""
        return "\n".join(message["content"] for message in self.messages)

    def to_json(self) -> dict:
        record = {"id": self.id, "source": self.source, "messages": [dict(m) for m in self.messages]}
        if self.response is not None:
            record["response"] = self.response
        return record


def user_prompt(id: str, source: str, text: str, response: str | None = None) -> Prompt:
    """A single-turn prompt."""
    return Prompt(id=id, source=source, messages=({"role": "user", "content": text},), response=response)


def normalize_text(text: str) -> str:
    """Case-, punctuation- and whitespace-insensitive form of a text: lowercase words separated by single spaces."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(re.findall(r"\w+", text))


@dataclass
class PromptFile:
    """What `read_prompt_file` found: the valid prompts and, for each skipped line, its number and the reason."""

    prompts: list[Prompt]
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (1-based line number, reason)


def parse_prompt_record(record: object, default_id: str, source: str = "file") -> Prompt:
    """One decoded JSON object -> Prompt; its own "source" field, if any, wins over `source`. Raises ValueError
    naming what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    prompt_id = record.get("id", default_id)
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
        raise ValueError('"id" must be a string or an integer')
    source = record.get("source", source)
    if not isinstance(source, str) or not source:
        raise ValueError('"source" must be a non-empty string')
    response = record.get("response")
    if response is not None and not isinstance(response, str):
        raise ValueError('"response" must be a string')
    if ("messages" in record) == ("prompt" in record):
        raise ValueError('expected exactly one of "messages" (a chat) or "prompt" (a string)')
    if "prompt" in record:
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError('"prompt" must be a non-empty string')
        return user_prompt(str(prompt_id), source, text, response)

    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ValueError(f"message {position} needs a role among {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str) or not message["content"].strip():
            raise ValueError(f"message {position} needs a non-empty string content")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if messages[-1]["role"] == "assistant":
        if response is not None:
            raise ValueError('give the response either as the last assistant message or as "response", not both')
        response = messages.pop()["content"]
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("the conversation must end with a user message (optionally followed by one assistant reply)")
    return Prompt(id=str(prompt_id), source=source, messages=tuple(messages), response=response)


def read_prompt_file(path: str | Path, source: str = "file") -> PromptFile:
    """Read a JSONL prompt file. Malformed lines (and repeated ids) are logged with their line numbers and skipped;
    a summary with the count follows. Blank lines are ignored. Lines without an id get "<source>:<line number>"."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist: give a JSONL file with one prompt per line")
    result = PromptFile(prompts=[])
    first_line_of_id: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                prompt = parse_prompt_record(json.loads(line), default_id=f"{source}:{number}", source=source)
                if prompt.id in first_line_of_id:
                    raise ValueError(f"id {prompt.id!r} already used on line {first_line_of_id[prompt.id]}")
            except ValueError as error:  # json.JSONDecodeError is a ValueError too
                result.skipped.append((number, str(error)))
                logger.warning("%s:%d: skipped: %s", path, number, error)
                continue
            first_line_of_id[prompt.id] = number
            result.prompts.append(prompt)
    if result.skipped:
        logger.warning(
            "%s: skipped %d malformed line(s) (lines %s); read %d prompt(s)",
            path,
            len(result.skipped),
            ", ".join(str(number) for number, _ in result.skipped),
            len(result.prompts),
        )
    return result


def write_prompt_file(prompts: Iterable[Prompt], path: str | Path) -> None:
    """Write prompts as JSONL that `read_prompt_file` reads back (ids, sources and responses kept). Atomically: a
    reader never sees half a file, and a kill leaves the previous file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(prompt.to_json(), ensure_ascii=False) + "\n" for prompt in prompts))


def truncate_prompt(prompt: Prompt, max_chars: int) -> Prompt:
    """Cut each message (and the response) to at most `max_chars` characters, at a whitespace when there is one.
    Long prompts are kept shortened rather than dropped: dropping by length removes whole kinds of data (code)."""

    def cut(text: str) -> str:
        if len(text) <= max_chars:
            return text
        head = text[:max_chars]
        space = head.rfind(" ", max_chars // 2)
        return head[:space] if space > 0 else head

    messages = tuple({"role": m["role"], "content": cut(m["content"])} for m in prompt.messages)
    response = cut(prompt.response) if prompt.response is not None else None
    return replace(prompt, messages=messages, response=response)


def allocate_counts(available: Mapping[str, int], weights: Mapping[str, float], total: int) -> dict[str, int]:
    """Split `total` among sources in proportion to `weights`, never giving a source more than it has: the share a
    small source cannot fill goes to the others, in proportion. Rounds by largest remainder (ties by name)."""
    counts = {name: 0 for name in weights}
    active = sorted(name for name, weight in weights.items() if weight > 0 and available.get(name, 0) > 0)
    remaining = total
    while remaining > 0 and active:
        weight_sum = sum(weights[name] for name in active)
        shares = {name: remaining * weights[name] / weight_sum for name in active}
        full = [name for name in active if shares[name] >= available[name] - counts[name]]
        if full:  # these sources give everything they have; split the rest again among the others
            for name in full:
                remaining -= available[name] - counts[name]
                counts[name] = available[name]
            active = [name for name in active if name not in full]
            continue
        floors = {name: int(shares[name]) for name in active}
        by_remainder = sorted(active, key=lambda name: (-(shares[name] - floors[name]), name))
        for name in by_remainder[: remaining - sum(floors.values())]:
            floors[name] += 1
        for name in active:
            counts[name] += floors[name]
        remaining = 0
    return counts


def mix_prompts(
    pools: Mapping[str, Sequence[Prompt]],
    proportions: Mapping[str, float],
    total: int,
    seed: int = 0,
    max_chars: int | None = None,
) -> list[Prompt]:
    """A deterministic, seeded mix of `total` prompts drawn from named pools in the given proportions.

    Prompts whose normalised text repeats one seen earlier (pools taken in name order) are dropped first. A pool
    smaller than its share gives all it has and the others fill the gap; the result is smaller than `total` only
    when all pools together are. `max_chars` truncates (never drops) long prompts. Output order is shuffled.
    """
    unknown = sorted(set(proportions) - set(pools))
    if unknown:
        raise ValueError(f"proportions name unknown prompt pools {unknown}; the pools are {sorted(pools)}")
    if any(weight < 0 for weight in proportions.values()) or not any(w > 0 for w in proportions.values()):
        raise ValueError(f"proportions must be non-negative with at least one positive: got {dict(proportions)}")
    if total <= 0:
        raise ValueError(f"the number of prompts to mix must be positive, got {total}")

    seen_texts: set[str] = set()
    seen_ids: set[str] = set()
    unique: dict[str, list[Prompt]] = {}
    for name in sorted(pools):
        unique[name] = []
        for prompt in pools[name]:
            if prompt.id in seen_ids:
                raise ValueError(f"prompt id {prompt.id!r} occurs twice; ids must be unique across pools")
            seen_ids.add(prompt.id)
            key = normalize_text(prompt.text)
            if key not in seen_texts:
                seen_texts.add(key)
                unique[name].append(prompt)

    counts = allocate_counts({name: len(p) for name, p in unique.items()}, proportions, total)
    mixed: list[Prompt] = []
    for name in sorted(counts):
        # A string seed is hashed with SHA-512 by `random`: stable across runs and Python versions.
        mixed.extend(random.Random(f"{seed}:{name}").sample(unique[name], counts[name]))
    random.Random(f"{seed}:order").shuffle(mixed)
    if len(mixed) < total:
        logger.warning("asked for %d prompts but the pools hold only %d distinct ones", total, len(mixed))
    if max_chars is not None:
        mixed = [truncate_prompt(prompt, max_chars) for prompt in mixed]
    logger.info("mixed %d prompts: %s", len(mixed), ", ".join(f"{n} {c}" for n, c in sorted(counts.items())))
    return mixed


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt through the tokenizer's chat template, ending with the assistant turn's opening."""
    return encode_chat(tokenizer, list(prompt.messages))
