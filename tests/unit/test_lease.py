"""The worker's lease (worker/service/lease.py): a request is written unchecked only while the
heartbeats have run unbroken since before it was claimed."""
from worker.service.lease import Lease


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_claimed_in_an_unbroken_run_is_held_until_a_beat_is_late():
    clock = Clock()
    lease = Lease(6.0, clock)
    assert not lease.holds(0.0)  # no heartbeat yet
    lease.beaten(0.0, 0.0)
    clock.now = 1.0
    assert lease.holds(1.0) and not lease.holds(-1.0)  # claimed before the run began: not held
    for sent in (2.0, 4.0, 6.0):
        clock.now = sent
        lease.beaten(sent, sent)
    clock.now = 8.9
    assert lease.holds(1.0)
    clock.now = 9.1  # more than half the TTL since the last beat: another may soon find it dead
    assert not lease.holds(1.0)


def test_after_a_gap_the_requests_claimed_before_it_are_never_held_again():
    clock = Clock()
    lease = Lease(6.0, clock)
    lease.beaten(0.0, 0.0)
    clock.now = 20.0  # paused past the TTL: its requests may have been taken over
    lease.beaten(20.0, 20.0)  # it resumes and beats before it publishes
    clock.now = 20.5
    assert not lease.holds(1.0)
    assert lease.holds(20.2)  # one claimed since is


def test_a_beat_whose_reply_came_late_is_a_gap_though_it_was_sent_in_time():
    """Stopped between reading the clock and its SET reaching Redis: the key may have lapsed."""
    clock = Clock()
    lease = Lease(6.0, clock)
    lease.beaten(0.0, 0.0)
    lease.beaten(2.0, 9.0)  # sent 2 s after the last, answered 9 s after it
    clock.now = 9.5
    assert not lease.holds(1.0) and not lease.holds(9.2)  # this key is surely alive only until 2 + 6
    lease.beaten(10.0, 10.0)  # a gap too (from 2.0): the hold starts again here
    clock.now = 10.5
    assert lease.holds(10.2) and not lease.holds(1.0)
