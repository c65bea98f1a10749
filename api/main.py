"""Entry point of one api replica."""
from __future__ import annotations

import uvicorn

from api.app import create_app
from shared.settings import ApiSettings


def main(settings: ApiSettings | None = None) -> None:
    settings = settings or ApiSettings()
    # One event loop, no reload: a replica is one process; run more of them to scale.
    # log_config=None: uvicorn's loggers go through the process's own set-up (text or JSON).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=None, timeout_graceful_shutdown=5)
