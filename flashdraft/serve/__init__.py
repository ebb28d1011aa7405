"""An OpenAI-compatible HTTP server over flashdraft's speculative decoding (`flashdraft serve`).

`schemas` holds the request and response models, `worker` the loaded models (`Engine`) and the thread that
decodes requests, `app` the FastAPI routes and the server, with `bodies` (request bodies read and limited),
`errors` (OpenAI's error schema) and `responses` (response bodies, event streams). Incremental detokenisation and
stop strings are in `flashdraft.text`.
"""

__all__ = ["Engine", "create_app"]


def __getattr__(name: str):
    # Imported on first use: the app needs the serve extra (FastAPI), which `flashdraft --help` must not.
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Engine":
        from .worker import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
