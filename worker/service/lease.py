"""This worker's hold on the requests it runs, as its heartbeat keeps it.

Another worker takes a request over only once this one's heartbeat key has expired in Redis
(heartbeat_ttl_s after the last one written). While every heartbeat has been sent within half
that TTL of the one before, since before a request was claimed, no takeover of it can have
happened, and its tokens may be written without the publisher's check of its record (the
script's HMGET, shared/lua/publisher_publish.lua): the cheap path. After a gap (a paused or
stalled process, Redis away), the requests claimed before it are written only through the check
until they end, since another worker may have taken them meanwhile; a resumed worker may well
beat again before it publishes, which is why the hold dates from the gap, not from the last beat.

A beat's gap is measured from the last beat's sending to this one's reply: the process may stop
between reading the clock and its SET reaching Redis, and the key may have expired meanwhile.
What the lease says holds when it is asked; the publisher asks only once its WATCH on the records
has reached Redis (worker/service/publisher.py), so a pause after the answer is caught there.
"""
from __future__ import annotations

import math
import time


class Lease:
    def __init__(self, ttl_s: float, clock=time.monotonic):
        self.margin = ttl_s / 2
        self.clock = clock
        self.sent = -math.inf  # when the last heartbeat that reached Redis was sent
        self.since = math.inf  # the start of the beats' unbroken run

    def beaten(self, sent: float, replied: float) -> None:
        """A heartbeat sent at `sent` reached Redis; its reply was read at `replied`."""
        # The last key lived at least until its sending + TTL; this one's SET reached Redis by `replied`.
        if replied - self.sent > self.margin:  # a gap: requests held before it may have been taken over
            self.since = replied  # claims after the new key surely reached Redis
        self.sent = sent

    def holds(self, claimed_at: float) -> bool:
        """Whether a request claimed at `claimed_at` (this clock) is surely still this worker's."""
        return self.since <= claimed_at and self.clock() - self.sent < self.margin
