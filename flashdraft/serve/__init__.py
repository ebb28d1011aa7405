"""An OpenAI-compatible HTTP server over flashdraft's speculative decoding (`flashdraft serve`).

`schemas` holds the request and response models, `text` the incremental detokenisation and stop strings,
`worker` the loaded models (`Engine`) and the thread that decodes queued requests, `app` the FastAPI routes.
"""

from .app import create_app
from .worker import Engine

__all__ = ["Engine", "create_app"]
