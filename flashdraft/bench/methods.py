"""The decoding methods a benchmark compares, each behind one call: prompt ids in, new token ids out.

    ar                   the target's own `generate` (plain autoregressive decoding: the baseline)
    flashdraft           `flashdraft.generate` with the DFlash draft alone, at one or more block sizes
    flashdraft-hybrid    `flashdraft.generate` with its default proposals: round by round the draft, the context's
                         lookup or both (`flashdraft.proposals`), at the adaptive block size
    flashdraft-plain     `flashdraft.generate` with block size 1 and no draft: plain decoding on flashdraft's loop and
                         target engine, so the proposals' own gain is the other flashdraft methods' speed over it
    flashdraft-lookup    `flashdraft.generate` with the context's lookup alone (no draft), at the adaptive block size
    prompt-lookup        transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`)
    assisted             transformers' assisted generation with a small model of the same tokenizer
    reference            the reference DFlash loop, PyPI `dflash==0.1.0` (`dflash_generate`), same draft weights
    transformers-dflash  transformers' own DFlash loop (`speculation_type="dflash"`), same draft weights
    llama.cpp            llama.cpp's plain decoding on the target's GGUF file (`llama-completion`)
    llama.cpp-lookup     llama.cpp's prompt lookup (`llama-lookup`)
    llama.cpp-dflash     llama.cpp's DFlash (`llama-speculative-simple --spec-type draft-dflash`), the same draft
                         converted to GGUF (`flashdraft.bench.llama_cpp` says how they run and are measured)

All methods decode the same target with the same stop tokens, the same token budget and the same sampling rule
(temperature only: top-p 1, no top-k); timing and acceptance are measured around them by `runner.py`.
"""

from __future__ import annotations

import copy
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.modeling_outputs import BaseModelOutput

import flashdraft
from flashdraft.bench import DRAFT_METHODS, LLAMA_CPP_METHODS, METHOD_NAMES
from flashdraft.bench.llama_cpp import TOOL_OF, LlamaCppPeer, ToolOutput, parse_output, tool_command
from flashdraft.draft import DFlashDraftModel
from flashdraft.rules import check_block_size
from flashdraft.target import TargetModel

PROMPT_LOOKUP_TOKENS = 10  # candidate tokens per lookup: transformers' documented example value
REFERENCE_REQUIREMENT = "dflash==0.1.0"


@dataclass(frozen=True)
class DecodeSettings:
    """What every method of one benchmark decodes with."""

    max_new_tokens: int
    temperature: float  # 0 is greedy
    stop_token_ids: tuple[int, ...]


class Method:
    """One way to decode the target. `generate` returns the new tokens only (prompt excluded); afterwards,
    `tokens_by_source` holds where they came from when the method knows (flashdraft's: accepted proposals per
    source, "target" for the rest), else nothing. A method that reports its own timing and rounds (`reports_rounds`)
    sets `first_token_seconds` and `acceptance_lengths`; the runner then puts no probe on the target, whose hooks
    would switch flashdraft's CPU engine off (it never calls the model's forward, so a probe would see nothing).
    A method that runs in another process and prints its own timings (llama.cpp's: `reports_timing`) also sets
    `seconds` (prefill and decode, no process start or model load), `decode_tokens` (the tokens its decode time
    covers), `drafted` and `accepted` (its proposal counts, where it has no per-round lengths), `text` (its answer
    as it printed it; its `tokens` are that text encoded by the target's tokenizer, cut to the budget) and `ended`
    (whether the model ended the answer before the budget)."""

    name: str
    tokens_by_source: dict[str, int] = {}
    reports_rounds = False
    reports_timing = False
    first_token_seconds: float = 0.0
    acceptance_lengths: list[int] = []
    seconds: float = 0.0
    decode_tokens: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    text: str | None = None
    ended: bool = False

    def generate(self, input_ids: torch.Tensor, settings: DecodeSettings, seed: int) -> list[int]:
        raise NotImplementedError


class TransformersGenerate(Method):
    """`target.generate` with the shared settings plus method-specific arguments (assistant, prompt lookup)."""

    def __init__(self, name: str, target: PreTrainedModel, **method_kwargs):
        self.name = name
        self.target = target
        self.method_kwargs = method_kwargs

    def generate(self, input_ids, settings, seed):
        torch.manual_seed(seed)  # transformers samples from the global generator
        sampling = settings.temperature > 0
        # Every sampling parameter is set explicitly: values left unset would be filled from the model's own
        # generation config (e.g. a default top_p), and the methods would no longer sample the same distribution.
        output = self.target.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=settings.max_new_tokens,
            min_new_tokens=0,
            do_sample=sampling,
            temperature=settings.temperature if sampling else None,
            top_p=1.0 if sampling else None,
            top_k=0 if sampling else None,
            repetition_penalty=1.0,
            eos_token_id=list(settings.stop_token_ids) or None,
            pad_token_id=settings.stop_token_ids[0] if settings.stop_token_ids else 0,
            **self.method_kwargs,
        )
        return output[0, input_ids.shape[1] :].tolist()


class FlashDraft(Method):
    reports_rounds = True

    def __init__(
        self, target: PreTrainedModel, draft: DFlashDraftModel | None, block_size: int | str,
        proposals: str | None = "dflash",
    ):
        if draft is None and proposals != "lookup":  # no draft: plain decoding
            self.name, block_size, proposals = "flashdraft-plain", 1, None
        else:
            self.name = "flashdraft-" + (proposals if proposals != "dflash" else
                                         block_size if block_size == "auto" else f"b{block_size}")
        self.target = TargetModel(target)
        self.draft = draft
        self.block_size = block_size
        self.proposals = proposals

    def generate(self, input_ids, settings, seed):
        result = flashdraft.generate(
            self.target,
            self.draft,
            input_ids,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            stop_token_ids=settings.stop_token_ids,
            block_size=self.block_size,
            seed=seed,
            proposals=self.proposals,
        )
        self.tokens_by_source = result.tokens_by_source
        self.first_token_seconds = result.time_to_first_token
        self.acceptance_lengths = result.acceptance_lengths
        return result.tokens


class Reference(Method):
    """`dflash.model.dflash_generate` from PyPI `dflash==0.1.0`, on the reference's own draft class holding our
    draft's weights (the checkpoint format is shared, so the state dict loads unchanged)."""

    def __init__(self, target: PreTrainedModel, draft: DFlashDraftModel):
        try:
            from dflash.model import DFlashDraftModel as ReferenceDraft
            from dflash.model import dflash_generate
        except ImportError:
            raise ValueError(
                "method 'reference' needs the reference implementation: "
                f"`pip install --no-deps {REFERENCE_REQUIREMENT}`"
            ) from None
        self.name = f"reference-b{draft.block_size}"
        self.target = target
        self.dflash_generate = dflash_generate
        parameter = next(draft.parameters())
        self.draft = ReferenceDraft(copy.deepcopy(draft.config))
        self.draft.load_state_dict(draft.state_dict(), strict=True)
        self.draft.to(device=parameter.device, dtype=parameter.dtype).eval()

    def generate(self, input_ids, settings, seed):
        torch.manual_seed(seed)  # the reference samples from the global generator
        # Without return_stats: its statistics call torch.cuda.synchronize, which a CPU-only torch lacks; the
        # runner times every method the same way instead.
        with warnings.catch_warnings():
            # It passes the target's cache under the name transformers 5.24 deprecates; nothing for our user to fix.
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            output = self.dflash_generate(
                self.draft,
                self.target,
                input_ids,
                settings.max_new_tokens,
                list(settings.stop_token_ids) or None,
                temperature=settings.temperature,
            )
        return output[0, input_ids.shape[1] :].tolist()


class TransformersDFlashAssistant(nn.Module):
    """Our DFlash draft in the shape transformers' `DFlashTokenCandidateGenerator` drives.

    That generator reads `target_layer_ids`, `block_size` and `mask_token_id` from the assistant's config top level
    (the checkpoint keeps the last two in `dflash_config`), and calls the assistant with keyword arguments
    `noise_embeds`, `context_hidden_states`, `position_ids`, `attention_mask`, `cache`, expecting an output with
    `last_hidden_state`. The computation is the draft's own forward, unchanged; the padding mask is dropped because
    benchmarks run one unpadded sequence, where every context and block position is visible.
    """

    def __init__(self, draft: DFlashDraftModel):
        super().__init__()
        self.draft = draft
        self.config = copy.deepcopy(draft.config)
        self.config.target_layer_ids = draft.target_layer_ids
        self.config.mask_token_id = draft.mask_token_id

    @property
    def device(self) -> torch.device:
        return next(self.draft.parameters()).device

    def forward(self, noise_embeds, context_hidden_states, position_ids, attention_mask=None, cache=None):
        hidden = self.draft(noise_embeds, context_hidden_states, position_ids, cache)
        return BaseModelOutput(last_hidden_state=hidden)


class LlamaCpp(Method):
    """One llama.cpp tool on the target's GGUF file, one process per prompt (`flashdraft.bench.llama_cpp`)."""

    reports_rounds = True
    reports_timing = True
    TIMEOUT_SECONDS = 3600

    def __init__(self, name: str, peer: LlamaCppPeer, tokenizer: PreTrainedTokenizerBase):
        self.name = name
        self.tool = TOOL_OF[name]
        self.peer = peer
        self.tokenizer = tokenizer
        self.output: ToolOutput | None = None

    def generate(self, input_ids, settings, seed):
        if settings.temperature != 0:
            raise ValueError(f"{self.name} runs greedy only (its sampling is not flashdraft's): use --temperature 0 "
                             "or drop the llama.cpp methods")
        prompt = self.tokenizer.decode(input_ids[0].tolist(), skip_special_tokens=False)
        stop_texts = tuple(self.tokenizer.decode([token]) for token in settings.stop_token_ids)
        with tempfile.TemporaryDirectory(prefix="flashdraft-llama-cpp-") as work:
            prompt_file = Path(work) / "prompt.txt"
            prompt_file.write_text(prompt, encoding="utf-8")
            command = tool_command(self.name, self.peer, prompt_file, input_ids.shape[1], settings.max_new_tokens)
            try:
                run = subprocess.run(command, capture_output=True, text=True, errors="replace",
                                     stdin=subprocess.DEVNULL, timeout=self.TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                raise ValueError(f"{self.tool} ran over {self.TIMEOUT_SECONDS} s on one prompt: stopped") from None
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["no output"])[-1]
            hint = (" (an instruction this CPU does not run: build llama.cpp on this machine with `flashdraft "
                    "llama-cpp build`)" if run.returncode in (-4, 132) else "")
            raise ValueError(f"{self.tool} failed with exit status {run.returncode}{hint}: {last}")
        output = self.output = parse_output(self.tool, run.stdout, run.stderr, prompt, stop_texts,
                                            settings.max_new_tokens)
        tokens = self.tokenizer.encode(output.text, add_special_tokens=False)[: settings.max_new_tokens]
        self.text, self.ended = output.text, output.ended
        self.first_token_seconds = output.prefill_seconds
        self.seconds = output.prefill_seconds + output.decode_seconds
        self.decode_tokens = output.decoded_tokens
        self.drafted, self.accepted = output.drafted, output.accepted
        self.acceptance_lengths = []  # the tools print totals, not rounds: tau comes from drafted and accepted
        return tokens


def build_methods(
    names: list[str],
    *,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    draft: DFlashDraftModel | None = None,
    block_sizes: list[int | str] | None = None,
    assistant: PreTrainedModel | None = None,
    assistant_tokenizer: PreTrainedTokenizerBase | None = None,
    llama_cpp: LlamaCppPeer | None = None,
) -> list[Method]:
    """The methods called `names`, `ar` first (the baseline every other is measured against).

    `flashdraft` (the draft alone) runs once per entry of `block_sizes` (default: the draft's own; "auto" = the
    adaptive block size of `flashdraft.adaptive`); `flashdraft-hybrid` at the adaptive block size; `reference` and
    `transformers-dflash` at the draft's block size. The llama.cpp methods need `llama_cpp`
    (`flashdraft.bench.llama_cpp.prepare_peer`).
    """
    unknown = [name for name in names if name not in METHOD_NAMES]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(METHOD_NAMES)}")
    needs_draft = DRAFT_METHODS & set(names)
    if needs_draft and draft is None:
        raise ValueError(f"method(s) {', '.join(sorted(needs_draft))} need a draft: pass --draft PATH")
    if "assisted" in names:
        if assistant is None:
            raise ValueError("method 'assisted' needs a small model with the target's tokenizer: pass --assistant")
        if assistant_tokenizer is not None and assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                "the assistant's tokenizer differs from the target's: assisted generation here needs the same "
                "vocabulary (pick an assistant from the target's model family)"
            )
    if LLAMA_CPP_METHODS & set(names) and llama_cpp is None:
        raise ValueError("the llama.cpp methods need llama.cpp's tools and the target's GGUF file: prepare them with "
                         "flashdraft.bench.llama_cpp.prepare_peer")
    inputs = MethodInputs(target, draft, block_sizes, assistant, tokenizer, llama_cpp)
    return [method for name in dict.fromkeys(["ar", *names]) for method in BUILDERS[name](inputs)]


@dataclass
class MethodInputs:
    """What a method's builder may use: the models and the block sizes asked for."""

    target: PreTrainedModel
    draft: DFlashDraftModel | None
    block_sizes: list[int | str] | None
    assistant: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase | None = None
    llama_cpp: LlamaCppPeer | None = None


def _draft_alone(given: MethodInputs) -> list[Method]:
    methods = []
    for block_size in dict.fromkeys(given.block_sizes or [given.draft.block_size]):
        if block_size != "auto":
            check_block_size(block_size, minimum=2, what="a flashdraft method's block size",
                             hint=" (1 is plain decoding, `ar`)")
        methods.append(FlashDraft(given.target, given.draft, block_size))
    return methods


def _transformers_dflash(given: MethodInputs) -> list[Method]:
    return [TransformersGenerate(f"transformers-dflash-b{given.draft.block_size}", given.target,
                                 assistant_model=TransformersDFlashAssistant(given.draft), speculation_type="dflash")]


# Method name -> the methods it adds (several for `flashdraft`: one per block size). Adding a method is adding a row
# here and its name to flashdraft.bench.METHOD_NAMES (which the command line lists without importing torch).
BUILDERS: dict[str, Callable[[MethodInputs], list[Method]]] = {
    "ar": lambda given: [TransformersGenerate("ar", given.target)],
    "flashdraft": _draft_alone,
    "flashdraft-hybrid": lambda given: [FlashDraft(given.target, given.draft, "auto", "hybrid")],
    "flashdraft-plain": lambda given: [FlashDraft(given.target, None, 1, None)],
    "flashdraft-lookup": lambda given: [FlashDraft(given.target, None, "auto", "lookup")],
    "prompt-lookup": lambda given: [TransformersGenerate("prompt-lookup", given.target,
                                                         prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)],
    "assisted": lambda given: [TransformersGenerate("assisted", given.target, assistant_model=given.assistant)],
    "reference": lambda given: [Reference(given.target, given.draft)],
    "transformers-dflash": _transformers_dflash,
    **{name: (lambda given, name=name: [LlamaCpp(name, given.llama_cpp, given.tokenizer)]) for name in TOOL_OF},
}


def reference_available() -> bool:
    """Whether the reference implementation can be imported (its method is then part of the default set)."""
    try:
        import dflash.model  # noqa: F401
    except ImportError:
        return False
    return True
