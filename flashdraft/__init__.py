"""flashdraft: lossless speculative decoding with DFlash block-diffusion drafts."""

import os

# OpenMP's default busy-waiting makes torch on a shared CPU many times slower (measured 15x here when another
# process computes); passive waiting costs nothing when the machine is quiet. Only effective before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .lazy import lazy_exports  # noqa: E402

# The public names load on first use (PEP 562), so that `flashdraft --help` and other light uses of a submodule
# answer without loading torch and transformers.
_EXPORTS = {
    "GenerationResult": "decoding", "TokenStream": "decoding", "generate": "decoding", "stream": "decoding",
    "DFlashDraftModel": "draft", "default_target_layer_ids": "draft",
    "DEFAULT_TARGET": "models", "load_draft": "models", "load_target": "models",
    "TargetModel": "target",
    "encode_chat": "text", "stop_token_ids": "text",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "DEFAULT_TARGET",
    "DFlashDraftModel",
    "GenerationResult",
    "TargetModel",
    "TokenStream",
    "default_target_layer_ids",
    "encode_chat",
    "generate",
    "load_draft",
    "load_target",
    "stop_token_ids",
    "stream",
]
__version__ = "0.1.0"
