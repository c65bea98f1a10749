"""Fixtures of the e2e tests that speak OpenAI's api to the shared tiny-model stack."""
from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(stack):
    """The official openai client on the stack's first replica (a module may define its own)."""
    return openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(stack):
    return stack.model_name
