"""Run every method on every prompt in one process, interleaved prompt by prompt, and time them the same way.

Each method is measured from the outside by the same instruments, so no method reports on itself:
- a wall clock around the call (with CUDA synchronisation before and after on a GPU);
- a probe on the target model's forward: the end of its first forward (the prefill, which yields the first token)
  gives the time to first token, and the target's cache length at the start of each later forward gives the
  tokens each verification round added (the acceptance lengths; plain decoding adds one per forward).
Only where the tokens came from (which proposer, for flashdraft's methods) is the method's own account, and the
timings and proposal counts of a method in another process (llama.cpp's, which loads the model on every call: the
wall clock would count the load), which are what it prints (`flashdraft.bench.llama_cpp`).

Methods run after a warm-up, prompt by prompt, in an order that rotates from one prompt to the next so no method
always runs first. A later turn of a multi-turn sample (MT-Bench's second question) follows the answer of `ar`,
the target's own plain decoding, so every method gets exactly the same input ids.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..evaluation.datasets import Sample
from ..target import synchronize
from ..text import encode_chat
from .methods import DecodeSettings, Method

WARMUP_TOKENS = 16


@dataclass
class Record:
    """One method's answer to one prompt (one turn of one sample)."""

    dataset: str
    sample_id: str
    turn: int
    method: str
    prompt_tokens: int
    tokens: list[int]  # new tokens only
    seconds: float  # the whole call
    time_to_first_token: float  # until the target's prefill forward ended
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens added per target forward after the prefill
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # the method's own account; empty when it has none
    text: str = ""  # the answer's text: the tokens decoded (special tokens skipped), or as the method printed it
    tokens_from_text: bool = False  # `tokens` are `text` encoded again (a method that prints text, not token ids)
    decode_tokens: int | None = None  # the tokens the decode seconds cover, when the method counts them itself
    drafted: int | None = None  # proposals verified and accepted, when the method counts them itself (llama.cpp's)
    accepted: int | None = None
    ended: bool = False  # the model ended the answer (a stop token) before the token budget

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.time_to_first_token

    def to_dict(self) -> dict:
        return asdict(self)


class TargetProbe:
    """Hooks on the target model's forward (use as a context manager around one generation).

    `starts` holds the target cache length at the start of every forward: the number of positions already verified.
    `first_forward_end` is the clock time when the first forward (the prefill) finished.
    """

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.starts: list[int] = []
        self.first_forward_end: float | None = None

    def __enter__(self) -> TargetProbe:
        self.handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def _before(self, module, args, kwargs):
        # transformers 5.24 takes the cache as `cache`; older callers (the reference) still pass `past_key_values`.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.starts.append(cache.get_seq_length() if cache is not None else 0)

    def _after(self, module, args, output):
        if self.first_forward_end is None:
            synchronize(self.device)
            self.first_forward_end = time.perf_counter()

    def acceptance_lengths(self, prompt_tokens: int, new_tokens: int) -> list[int]:
        """Tokens added by each forward after the prefill.

        A forward that starts with s positions verified checks the token at position s (the last one emitted,
        not yet in the cache) and what follows it; the next forward starts where this one's accepted tokens end.
        The last token of the answer sits at position prompt_tokens + new_tokens - 1, which closes the last round.
        """
        if new_tokens == 0:
            return []
        ends = self.starts[2:] + [prompt_tokens + new_tokens - 1]
        return [end - start for start, end in zip(self.starts[1:], ends)]


def measure(
    method: Method,
    model: nn.Module,
    input_ids: torch.Tensor,  # [1, P]
    settings: DecodeSettings,
    seed: int,
) -> tuple[list[int], float, float, list[int]]:
    """Run `method` once: (new tokens, seconds, time to first token, acceptance lengths)."""
    device = input_ids.device
    if method.reports_timing:
        tokens = method.generate(input_ids, settings, seed)
        return tokens, method.seconds, method.first_token_seconds, list(method.acceptance_lengths)
    if method.reports_rounds:
        synchronize(device)
        began = time.perf_counter()
        tokens = method.generate(input_ids, settings, seed)
        synchronize(device)
        return tokens, time.perf_counter() - began, method.first_token_seconds, list(method.acceptance_lengths)
    with TargetProbe(model, device) as probe:
        synchronize(device)
        began = time.perf_counter()
        tokens = method.generate(input_ids, settings, seed)
        synchronize(device)
        seconds = time.perf_counter() - began
    first_token = probe.first_forward_end - began if probe.first_forward_end is not None else seconds
    return tokens, seconds, first_token, probe.acceptance_lengths(input_ids.shape[1], len(tokens))


def run_benchmark(
    methods: list[Method],
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    datasets: dict[str, list[Sample]],
    settings: DecodeSettings,
    *,
    seed: int = 0,
    chat_template: bool = True,
) -> list[Record]:
    """Every method on every turn of every sample; `methods[0]` must be `ar`, whose answers later turns follow."""
    if not methods or methods[0].name != "ar":
        raise ValueError("the first method must be 'ar': speedups and later turns are measured against it")
    device = model.device
    requests = sum(len(sample.turns) for samples in datasets.values() for sample in samples)
    if requests == 0:
        raise ValueError("no prompts to run: every dataset is empty")

    def prompt_ids(sample: Sample, answers: list[str]) -> torch.Tensor:
        return torch.tensor([encode_chat(tokenizer, sample.messages(answers), chat_template)], device=device)

    first_sample = next(sample for samples in datasets.values() for sample in samples)
    warmup = DecodeSettings(min(WARMUP_TOKENS, settings.max_new_tokens), settings.temperature, settings.stop_token_ids)
    for method in tqdm(methods, desc="Warm-up", unit="method", leave=False):
        method.generate(prompt_ids(first_sample, []), warmup, seed)

    records: list[Record] = []
    request = 0  # index of the current prompt: rotates the method order and seeds the sampling
    progress = tqdm(total=requests * len(methods), desc="Benchmark", unit="run")
    with progress:
        for dataset, samples in datasets.items():
            for sample in samples:
                answers: list[str] = []
                for turn in range(len(sample.turns)):
                    input_ids = prompt_ids(sample, answers)
                    shift = request % len(methods)
                    baseline = None
                    for method in methods[shift:] + methods[:shift]:
                        progress.set_postfix_str(f"{dataset} {sample.id} {method.name}", refresh=False)
                        tokens, seconds, first_token, lengths = measure(
                            method, model, input_ids, settings, seed + request
                        )
                        printed = method.text is not None
                        records.append(
                            Record(dataset, sample.id, turn, method.name, input_ids.shape[1], tokens, seconds,
                                   first_token, lengths, dict(method.tokens_by_source),
                                   method.text if printed else tokenizer.decode(tokens, skip_special_tokens=True),
                                   printed, method.decode_tokens, method.drafted, method.accepted,
                                   method.ended if printed else bool(tokens) and tokens[-1] in settings.stop_token_ids)
                        )
                        if method is methods[0]:
                            baseline = tokens
                        progress.update()
                    answers.append(tokenizer.decode(baseline, skip_special_tokens=True))
                    request += 1
    return records
