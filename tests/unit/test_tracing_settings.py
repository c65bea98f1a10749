"""The OTLP protocol a process exports its spans over: a wrong value is refused, naming the
variable that gave it (the traces' own wins over the general one)."""
from __future__ import annotations

import pytest

from shared import tracing


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"])
def test_a_wrong_protocol_is_refused_naming_the_variable_that_gave_it(monkeypatch, variable):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv(variable, "http/json")
    with pytest.raises(ValueError, match=f"^{variable} is 'http/json'"):
        tracing.configure("test")
    assert not tracing.enabled()
