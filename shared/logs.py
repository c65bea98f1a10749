"""Process logging: text for a terminal, or one JSON object per line for a log pipeline.

In JSON, every field a call passes with `extra=` (request_id, worker, timings, ...) becomes a
key of its line, so `jq 'select(.request_id == "...")'` follows one request through every
process.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        line.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup(level: str, fmt: str) -> None:
    """Configure the root logger once per process; uvicorn's loggers propagate to it.

    In JSON every line must be JSON: progress bars (tqdm's, as transformers and huggingface_hub
    draw them while loading a model) are off, in this process and the ones it starts, and
    warnings go through the log."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if fmt == "json":
        os.environ["TQDM_DISABLE"] = os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        logging.captureWarnings(True)


def route_transformers() -> None:
    """transformers logs through a plain-text stderr handler of its own: with JSON logs, send its
    records through ours instead. Call where transformers is used (it is a no-op otherwise)."""
    if not any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        return
    from transformers.utils import logging as hf_logging  # heavy, worker side only

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
