"""Entry point of one api replica."""
from __future__ import annotations

import logging

import uvicorn

from api.app import create_app
from shared.model_paths import model_dir
from shared.model_source import ModelNotFound
from shared.settings import ApiSettings
from shared.tokenizer import Tokenizer

log = logging.getLogger("streamq.api")


def main(settings: ApiSettings | None = None) -> None:
    settings = settings or ApiSettings()
    try:  # before the server: a model it cannot find, or a setting that cannot work, is one line at start
        tokenizer = Tokenizer(model_dir(settings))
        app = create_app(settings, tokenizer)
    except (ModelNotFound, ValueError) as exc:
        log.critical("%s", exc)
        raise SystemExit(2) from exc
    # One event loop, no reload: a replica is one process; run more of them to scale.
    # log_config=None: uvicorn's loggers go through the process's own set-up (text or JSON).
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=None, timeout_graceful_shutdown=5)
