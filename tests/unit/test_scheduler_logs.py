"""The scheduler's log: arq's start and end lines of the cron jobs, every few seconds, are dropped;
everything else arq says is kept (scheduler/main.py QuietCron)."""
from __future__ import annotations

import inspect
import logging

import arq.worker
import pytest

from scheduler.main import ARQ_RUN_LINES, QuietCron

CRON = "{arq:abort}:streamq:cron:reclaim"


def _record(level: int, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("arq.worker", level, __file__, 1, msg, args, None)


def test_the_filtered_lines_are_the_ones_arq_writes():
    source = inspect.getsource(arq.worker)
    assert all(f"'{line}'" in source for line in ARQ_RUN_LINES)


@pytest.fixture
def arq_level():
    logger = logging.getLogger("arq.worker")
    before = logger.level
    yield logger.setLevel
    logger.setLevel(before)


def test_a_cron_jobs_start_and_end_are_dropped_and_the_rest_kept(arq_level):
    arq_level(logging.INFO)
    quiet = QuietCron()
    start, end = ARQ_RUN_LINES
    assert not quiet.filter(_record(logging.INFO, start, 1.0, CRON, "", ""))
    assert not quiet.filter(_record(logging.INFO, end, 0.0, CRON, "{}"))
    assert quiet.filter(_record(logging.INFO, start, 1.0, "streamq:batch_1:run_batch", "'batch_1'", ""))
    assert quiet.filter(_record(logging.INFO, "%6.2fs ↻ %s retrying job in %0.2fs", 1.0, CRON, 2.0))
    assert quiet.filter(_record(logging.ERROR, "%6.2fs ! %s failed, %s: %s", 1.0, CRON, "X", "y"))
    arq_level(logging.DEBUG)  # asked for: every line
    assert quiet.filter(_record(logging.INFO, start, 1.0, CRON, "", ""))
