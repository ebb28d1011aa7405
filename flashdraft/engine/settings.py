"""Every setting of the CPU engine, read from the environment in one place: `EngineSettings.from_environment()`,
called when an engine is built (the command line's `--arithmetic` reaches it through `load_target`). Each cache key
that depends on a setting (kernels, verify costs) takes it from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# How the target's products are computed (FLASHDRAFT_ARITHMETIC, `flashdraft generate --arithmetic`): float32, the
# same as transformers' forward; int8, the GGUF checkpoint's own blocks against activations rounded to 8-bit codes
# per 32 values (`quantized`, `csrc/block_gemm.c`), what llama.cpp computes; auto, int8 where the target has GGUF
# blocks.
ARITHMETICS = ("auto", "float32", "int8")
CHECKED_ROWS = 64  # rows of each weight compared with its blocks where a checksum covers the blocks file


# The environment variables the engine reads, each "1" (on) unless set to "0" (off); FLASHDRAFT_ARITHMETIC names.
VARIABLES = ("FLASHDRAFT_ARITHMETIC", "FLASHDRAFT_PACKED", "FLASHDRAFT_NATIVE_ATTENTION", "FLASHDRAFT_DRAFT_BF16",
             "FLASHDRAFT_DRAFT_INT8")


@dataclass(frozen=True)
class EngineSettings:
    """arithmetic: ARITHMETICS' choice (FLASHDRAFT_ARITHMETIC); packed: a float32 weight read in its exactly packed
    form (FLASHDRAFT_PACKED); native_attention: attention on the native kernel where it fits
    (FLASHDRAFT_NATIVE_ATTENTION); draft_bf16 / draft_int8: a shipped draft's products in bfloat16 / 8-bit
    arithmetic (FLASHDRAFT_DRAFT_BF16 / FLASHDRAFT_DRAFT_INT8)."""

    arithmetic: str = "auto"
    packed: bool = True
    native_attention: bool = True
    draft_bf16: bool = True
    draft_int8: bool = True

    @classmethod
    def from_environment(cls) -> EngineSettings:
        def on(name: str) -> bool:
            return os.environ.get(name, "1") != "0"

        return cls(os.environ.get("FLASHDRAFT_ARITHMETIC", "auto"), on("FLASHDRAFT_PACKED"),
                   on("FLASHDRAFT_NATIVE_ATTENTION"), on("FLASHDRAFT_DRAFT_BF16"), on("FLASHDRAFT_DRAFT_INT8"))

    def key(self) -> dict:
        """The settings as part of a cache key."""
        return {"arithmetic": self.arithmetic, "packed": self.packed, "native_attention": self.native_attention,
                "draft_bf16": self.draft_bf16, "draft_int8": self.draft_int8}


def arithmetic_setting() -> str:
    """FLASHDRAFT_ARITHMETIC alone (`TargetModel.engine` asks it on every access, so one lookup, not all five)."""
    return os.environ.get("FLASHDRAFT_ARITHMETIC", "auto")

