"""The worker's Backend (worker/engine/backend.py) and the built-in engines' BaseEngine are abstract
base classes: a backend or an engine that leaves out a method the worker calls cannot be made, and
what one may lack is a declared answer, never probed."""
from __future__ import annotations

import inspect

import pytest

from worker.backends.null_engine import NullEngine
from worker.backends.vllm_backend import VllmBackend
from worker.engine.backend import Backend, Counts
from worker.engine.base import BaseEngine
from worker.engine.threaded import Threaded


def _backend_lacking(missing: str) -> type[Backend]:
    """A Backend subclass with every abstract method but `missing`."""
    namespace = {}
    for name in Backend.__abstractmethods__ - {missing}:
        member = inspect.getattr_static(Backend, name)
        namespace[name] = property(lambda self: None) if isinstance(member, property) else (lambda self, *a: None)
    return type(f"Without_{missing}", (Backend,), namespace)


@pytest.mark.parametrize("missing", sorted(Backend.__abstractmethods__))
def test_a_backend_missing_a_method_cannot_be_made(missing):
    with pytest.raises(TypeError, match=missing):
        _backend_lacking(missing)()


def test_the_abstract_methods_are_what_the_worker_calls():
    assert Backend.__abstractmethods__ == {"add", "cancel", "free_slots", "running", "waiting", "last_step_size",
                                           "has_work", "step", "fail_all", "plan", "close"}


def test_the_optional_readings_have_the_answer_of_a_backend_without_them():
    backend = _backend_lacking("")()
    backend.name = "bare"
    assert (backend.pools, backend.lora) == (False, False)  # class-level capability flags
    assert backend.kv_blocks() is None and backend.counts() == Counts() and backend.phase_seconds() == {}
    assert backend.batch_invariant is False and backend.adapters is None
    with pytest.raises(NotImplementedError, match="the bare backend serves no LoRA adapters"):
        backend.learn_adapters({})


def test_every_backend_is_one():
    assert issubclass(Threaded, Backend) and issubclass(VllmBackend, Backend)
    assert not VllmBackend.__abstractmethods__ and not Threaded.__abstractmethods__


def test_an_engine_missing_a_method_cannot_be_made():
    class NoStep(BaseEngine):
        plan = None

        def add(self, payload, resumed=()):
            raise AssertionError

        def _running_or_waiting(self):
            return []

        def _forget(self, seq):
            pass

        def _reset(self):
            pass

    with pytest.raises(TypeError, match="step"):
        NoStep(1)


async def test_a_built_in_engine_says_what_it_has_through_threaded():
    backend = Threaded(NullEngine(batch_size=2, tokens_per_s=10), "null")
    try:
        assert (backend.pools, backend.lora, backend.adapters, backend.batch_invariant) == (False, False, None, False)
        assert backend.plan.engine == "null" and backend.phase_seconds() == {} and backend.kv_blocks() is None
        with pytest.raises(NotImplementedError, match="serves no LoRA adapters"):
            backend.learn_adapters({})
    finally:
        await backend.close()
