"""Server-Sent Events read back into events, as a client sees them (tests and benchmarks)."""
from __future__ import annotations

import json


def parse_sse(lines) -> list[dict]:
    """Group SSE lines into events: {'id', 'event', 'data'} (data decoded from JSON)."""
    events, current = [], {}
    for line in lines:
        if line == "":
            if "data" in current:
                current["data"] = json.loads(current["data"])
                events.append(current)
            current = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            current[field] = value[1:] if value.startswith(" ") else value
    return events
