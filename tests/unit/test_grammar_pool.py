"""The api's grammar pool (api/core/grammar_pool.py): real spawned processes. A compile past the
time cap has its process killed and replaced and its request refused naming the cap; the pool
then serves the next compile. Compiles held by named pipes (tests/grammar_hold.py), never by time."""
from __future__ import annotations

import json
import os
import select

import pytest

from api.core.errors import ApiError
from api.core.generation import Generation
from api.core.grammar_pool import CompileTimeout, GrammarPool
from shared.structured import StructuredOutputs
from tests.grammar_hold import Hold

OBJECT = json.dumps({"json_object": True})


@pytest.fixture
def hold(tmp_path):
    hold = Hold(tmp_path)
    yield hold
    hold.close()


def _ends(pid: int, bound_s: float = 60.0) -> bool:
    """Whether the process has ended or ends (its pidfd turns readable), failing after `bound_s`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # ended and reaped already
        return True
    try:
        return bool(select.select([fd], [], [], bound_s)[0])
    finally:
        os.close(fd)


async def test_verdicts_come_from_the_processes():
    pool = GrammarPool(2, timeout_s=60)
    try:
        assert await pool.verdict(OBJECT) == ""
        refused = await pool.verdict(json.dumps({"regex": "[0-9"}))
        assert refused.startswith("regex: ") and "unclosed" in refused
        await pool.ready()
        assert len(pool.pids()) == 2 and os.getpid() not in pool.pids()
    finally:
        await pool.close()


async def test_a_compile_past_the_cap_is_killed_and_its_process_replaced(hold):
    pool = GrammarPool(1, timeout_s=1.0, check=hold.check)
    try:
        await pool.ready()  # the process is up: the cap times the compile alone
        [first] = pool.pids()
        with pytest.raises(CompileTimeout) as info:
            await pool.verdict(OBJECT)  # held, never released: it cannot finish within the cap
        assert "1 s" in str(info.value) and "STREAMQ_COMPILE_TIMEOUT_S" in str(info.value)
        assert _ends(first)
        await pool.ready()
        [second] = pool.pids()
        assert second != first
        hold.release()  # the next compile runs through
        assert await pool.verdict(json.dumps({"regex": "[0-9]+"})) == ""
        assert hold.compiles() == 2 and pool.pids() == [second]
    finally:
        await pool.close()


async def test_the_request_gets_the_cap_as_its_error_naming_the_field(hold):
    """Generation.check_constraint: 422, which the OpenAI and Anthropic paths answer as 400."""
    pool = GrammarPool(1, timeout_s=1.0, check=hold.check)
    generation = Generation(None, None, None, "m", default_max_tokens=4, grammars=pool)
    try:
        await pool.ready()
        with pytest.raises(ApiError) as info:
            await generation.check_constraint(StructuredOutputs(json_object=True), "response_format", "t")
        assert info.value.status == 422 and info.value.param == "response_format"
        assert info.value.message.startswith("response_format: compiling the constraint took longer than the 1 s")
    finally:
        await pool.close()


async def test_verdicts_are_kept_per_tenant(hold):
    """A tenant's repeated schema is answered without a compile; another tenant's same schema is
    compiled for it (no verdict crosses tenants: it would answer faster, telling what was sent)."""
    pool = GrammarPool(1, timeout_s=60, check=hold.check)
    try:
        hold.release(2)
        assert await pool.verdict(OBJECT, "a") == "" and await pool.verdict(OBJECT, "a") == ""
        assert hold.compiles() == 1
        assert await pool.verdict(OBJECT, "b") == ""
        assert hold.compiles() == 2 and pool.compiles == 2
    finally:
        await pool.close()
