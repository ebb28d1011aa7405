"""An OpenAI-compatible HTTP server over flashdraft's speculative decoding (`flashdraft serve`).

`schemas` holds the request and response models, `text` the incremental detokenisation and stop strings,
`worker` the loaded models (`Engine`) and the thread that decodes requests, `app` the FastAPI routes.
"""

__all__ = ["Engine", "create_app"]


def __getattr__(name: str):
    # Imported on first use: the app needs the serve extra (FastAPI), while `flashdraft.serve.text` is also used by
    # commands that must run without it.
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "Engine":
        from .worker import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
