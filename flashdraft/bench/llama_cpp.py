"""llama.cpp's tools as benchmark methods, on the same GGUF file as the target, and what their output says.

    llama.cpp         plain decoding: `llama-completion`
    llama.cpp-lookup  its prompt lookup: `llama-lookup --spec-draft-n-max 8`
    llama.cpp-dflash  its DFlash: `llama-speculative-simple --spec-type draft-dflash --spec-draft-n-max 7`, with our
                      draft converted to GGUF by llama.cpp's own converter (`flashdraft.llama_cpp`)

Every call starts the tool on the chat-templated prompt text exactly as flashdraft's methods get it (decoded from
the same prompt ids, written to a file read byte for byte with `-bf`, since `-f` drops the file's trailing newline,
which ends every chat prompt, and with `--no-escape` so that a backslash stays a backslash), greedy
(`--temp 0`), the same new-token budget and the same thread count. The tool loads the model on every call, so the
wall clock would count a model load: the runner takes these methods' timings from what the tool prints instead:

    prefill  llama-completion's "prompt eval time"; the other tools' "encoded N tokens in S seconds"
    decode   llama-completion's "eval time = MS ms / N runs"; the other tools' "decoded N tokens in S seconds"

so a method's decode tokens/s is the tool's own decode speed. Acceptance: the tools print n_drafted and n_accept
(drafted tokens, accepted ones); each verification round emits its accepted tokens plus one of the target's, so
rounds = decoded - accepted and tau = decoded / rounds (plain decoding: 1).

The tools print text, not token ids. A method's answer is the text the tool printed after the prompt, without its
end-of-generation mark (llama-completion's " [end of text]", a stop token's own text); its tokens are that text
encoded by the target's tokenizer, cut to the budget. Answers are compared by text (`flashdraft.bench.metrics`):
the speculative tools may decode past the budget by part of a draft, and a text cut at a token count is not the
same cut in two tokenizations, so two answers agree when they are equal or when the shorter one, cut by the budget
(not ended by the model), begins the longer one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..llama_cpp import LlamaCpp, cached_draft_gguf, find_llama_cpp, target_gguf

LOOKUP_DRAFT_MAX = 8
DFLASH_DRAFT_MAX = 7
TOOL_OF = {"llama.cpp": "llama-completion", "llama.cpp-lookup": "llama-lookup",
           "llama.cpp-dflash": "llama-speculative-simple"}
END_OF_TEXT = " [end of text]"  # llama-completion's mark after an answer the model ended
CONTEXT_MARGIN = 64  # context positions beyond prompt + budget: a speculative round may run past the budget


@dataclass
class ToolOutput:
    """What one run of a llama.cpp tool printed: its answer's text and its own counts and timings."""

    text: str  # after the prompt; end-of-generation marks removed
    ended: bool  # the model ended the answer (a stop token), as far as the output shows
    prompt_tokens: int  # as llama.cpp tokenized the prompt
    prefill_seconds: float
    decoded_tokens: int  # the tokens the decode seconds cover
    decode_seconds: float
    drafted: int = 0  # n_drafted: proposals verified (0 for plain decoding)
    accepted: int = 0  # n_accept: proposals accepted

    @property
    def tau(self) -> float:
        """Tokens per verification round: rounds = decoded - accepted (each round emits one target token)."""
        rounds = self.decoded_tokens - self.accepted
        return self.decoded_tokens / rounds if rounds > 0 else 0.0


_NUMBER = r"([0-9]+(?:\.[0-9]*)?)"
_PATTERNS = {
    "prompt eval": re.compile(rf"prompt eval time =\s*{_NUMBER} ms /\s*([0-9]+) tokens"),
    "eval": re.compile(rf"(?<!prompt )eval time =\s*{_NUMBER} ms /\s*([0-9]+) runs"),
    "encoded": re.compile(rf"encoded\s+([0-9]+) tokens in\s+{_NUMBER} seconds"),
    "decoded": re.compile(rf"decoded\s+([0-9]+) tokens in\s+{_NUMBER} seconds"),
    "n_drafted": re.compile(r"n_drafted\s*=\s*([0-9]+)"),
    "n_accept": re.compile(r"n_accept\s*=\s*([0-9]+)"),
}


def _find(name: str, log: str, tool: str) -> re.Match:
    # The first match: a tool's own summary comes before the target's perf lines that some tools print after it.
    match = _PATTERNS[name].search(log)
    if match is None:
        raise ValueError(f"{tool} printed no '{name}' line: not the llama.cpp this benchmark knows (its output "
                         f"format changed?); build the tested one with `flashdraft llama-cpp build`")
    return match


def parse_output(
    tool: str, stdout: str, log: str, prompt: str, stop_texts: tuple[str, ...] = (), max_new_tokens: int = 0
) -> ToolOutput:
    """Read `tool`'s answer from its stdout and its counts and timings from its log (stderr).

    Every tool echoes the prompt as llama.cpp renders its tokens (llama-completion with `--special`, so that its
    special tokens are written too; the other tools after two newlines), then the answer and a stop token's text if
    the model ended it; llama-completion then marks that end with " [end of text]" and a newline. llama-completion
    ends its output with two newlines, the other tools with four.
    """
    speculative = tool != "llama-completion"
    text = stdout.removeprefix("\n\n") if speculative else stdout
    if not text.startswith(prompt):
        raise ValueError(f"{tool} did not echo the prompt as given before its answer: the prompt text did not "
                         "survive llama.cpp's tokenizer unchanged, so its answer cannot be compared")
    text = text[len(prompt):]
    text = text.removesuffix("\n\n\n\n" if speculative else "\n\n")
    ended = not speculative and text.endswith(END_OF_TEXT + "\n")
    text = text.removesuffix(END_OF_TEXT + "\n")
    for stop in stop_texts:
        if stop and text.endswith(stop):
            text, ended = text[: -len(stop)], True
            break
    if tool == "llama-completion":
        prompt_eval, evaluation = _find("prompt eval", log, tool), _find("eval", log, tool)
        return ToolOutput(text, ended, int(prompt_eval.group(2)), float(prompt_eval.group(1)) / 1000,
                          int(evaluation.group(2)), float(evaluation.group(1)) / 1000)
    encoded, decoded = _find("encoded", log, tool), _find("decoded", log, tool)
    # llama-speculative-simple stops at a stop token without printing it: fewer tokens than the budget show it
    ended = ended or decoded.group(1) is not None and int(decoded.group(1)) <= max_new_tokens
    return ToolOutput(text, ended, int(encoded.group(1)), float(encoded.group(2)), int(decoded.group(1)),
                      float(decoded.group(2)), int(_find("n_drafted", log, tool).group(1)),
                      int(_find("n_accept", log, tool).group(1)))


@dataclass(frozen=True)
class LlamaCppPeer:
    """What every llama.cpp method of one benchmark shares: the build, the target's GGUF, the draft's (for
    llama.cpp-dflash) and the thread count."""

    llama: LlamaCpp
    target_gguf: Path
    draft_gguf: Path | None
    threads: int

    def describe(self) -> dict:
        return {**self.llama.describe(), "target_gguf": str(self.target_gguf),
                "draft_gguf": str(self.draft_gguf) if self.draft_gguf else None, "threads": self.threads}


def prepare_peer(
    names: list[str], folder: Path | None, target: str, draft_folder: Path | None, threads: int
) -> LlamaCppPeer:
    """Check that the tools `names` need are built (a one-line error saying how to build them if not), find the
    target's GGUF (a registry target's; assembled from its parts once) and convert the draft for llama.cpp-dflash."""
    from ..models import REGISTRY, prepare

    llama = find_llama_cpp(folder, tuple(TOOL_OF[name] for name in names))
    if target not in REGISTRY:
        raise ValueError(f"the llama.cpp methods run the target's GGUF file, which only registry targets have "
                         f"({', '.join(REGISTRY)}): drop {', '.join(names)} or bench a registry target")
    draft_gguf = None
    if "llama.cpp-dflash" in names:
        if draft_folder is None:
            raise ValueError("llama.cpp-dflash needs a draft: pass --draft PATH (or bench a target a draft is "
                             "shipped for)")
        draft_gguf = cached_draft_gguf(Path(draft_folder), prepare(target), llama)
    return LlamaCppPeer(llama, target_gguf(target), draft_gguf, threads)


def tool_command(
    name: str, peer: LlamaCppPeer, prompt_file: Path, prompt_tokens: int, max_new_tokens: int
) -> list[str]:
    """The command line of method `name` (a key of `TOOL_OF`) on one prompt file, greedy."""
    # -bf, not -f: llama.cpp drops a trailing newline from a -f file, and a chat prompt ends with one
    common = ["-m", str(peer.target_gguf), "-bf", str(prompt_file), "-n", str(max_new_tokens), "--temp", "0",
              "-t", str(peer.threads), "--no-escape", "-c", str(prompt_tokens + max_new_tokens + CONTEXT_MARGIN)]
    extra = {
        "llama.cpp": ["-no-cnv", "--special"],
        "llama.cpp-lookup": ["--spec-draft-n-max", str(LOOKUP_DRAFT_MAX)],
        "llama.cpp-dflash": ["-md", str(peer.draft_gguf), "--spec-type", "draft-dflash",
                             "--spec-draft-n-max", str(DFLASH_DRAFT_MAX)],
    }[name]
    return [str(peer.llama.tool(TOOL_OF[name])), *common, *extra]
