"""flashdraft: lossless speculative decoding with DFlash block-diffusion drafts."""

from .lazy import lazy_exports

# The public names load on first use (PEP 562), so that `flashdraft --help` and other light uses of a submodule
# answer without loading torch and transformers.
_EXPORTS = {
    "GenerationResult": "decoding", "TokenStream": "decoding", "generate": "batching", "stream": "decoding",
    "Batch": "batching",
    "DFlashDraftModel": "draft", "default_target_layer_ids": "draft",
    "DEFAULT_TARGET": "models", "load_draft": "models", "load_target": "models",
    "TargetModel": "target",
    "encode_chat": "text", "stop_token_ids": "text",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "Batch",
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
