"""Fair admission between tenants, driven through the real batcher with plain numbers."""
import itertools

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import Detokenizer
from worker.engine.fair_queue import FairQueue
from worker.engine.sequence import Sequence, Status

_ids = itertools.count()
OUTPUT = 8  # tokens each request generates


def request(tenant: str, priority: int = 0, weight: float = 1.0, tier: str = "default") -> Sequence:
    n = next(_ids)
    payload = RequestPayload(id=f"{tenant}{n}", model="m", prompt_token_ids=[1 + n % 7, 2, 3, 4],
                             params=SamplingParams(max_tokens=OUTPUT), tenant=tenant, priority=priority,
                             weight=weight, service_tier=tier)
    return Sequence.of(payload, Detokenizer(lambda ids: ""))


class Run:
    """A batcher stepped as the engine steps it; records the order requests are admitted in."""

    def __init__(self, max_num_seqs: int = 4):
        self.batcher = Batcher(BlockManager(256, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
        self.admitted: list[Sequence] = []
        self.served: dict[str, int] = {}

    def step(self) -> None:
        before = set(map(id, self.batcher.running))
        out = self.batcher.schedule()
        for chunk in out.chunks:
            self.batcher.computed(chunk)
        self.admitted += [s for s in self.batcher.running if id(s) not in before]
        for chunk in out.chunks:
            if chunk.samples:
                chunk.seq.append(7)
                tenant = chunk.seq.tenant
                self.served[tenant] = self.served.get(tenant, 0) + 1
                if len(chunk.seq.output_ids) == OUTPUT:
                    self.batcher.remove(chunk.seq)


def test_a_small_tenant_is_admitted_ahead_of_a_big_backlog():
    run = Run(max_num_seqs=4)
    for _ in range(200):
        run.batcher.add(request("a"))
    for _ in range(20):
        run.step()
    arrived = len(run.admitted)
    b = [request("b") for _ in range(10)]
    for seq in b:
        run.batcher.add(seq)
    while any(seq not in run.admitted for seq in b):
        run.step()
    after = [s.tenant for s in run.admitted[arrived:]]
    # FIFO would admit 180 of a's requests first. Fair share: a has run alone, so b takes the
    # slots that free next; then, as b's tokens are charged, the two take turns.
    assert after[:4] == ["b"] * 4, after
    assert len(after) <= 20, after  # all ten of b's within 20 admissions (here: bbbbaaaabbbbaaaabb)


def test_weights_share_the_tokens():
    run = Run(max_num_seqs=4)
    for _ in range(300):
        run.batcher.add(request("heavy", weight=3.0))
        run.batcher.add(request("light", weight=1.0))
    for _ in range(400):
        run.step()
    ratio = run.served["heavy"] / run.served["light"]
    assert 2.5 <= ratio <= 3.5, run.served


def test_priority_orders_a_tenants_own_requests():
    run = Run(max_num_seqs=1)
    low, high, normal = request("a", priority=5), request("a", priority=-5), request("a")
    for seq in (low, high, normal):
        run.batcher.add(seq)
    while len(run.admitted) < 3:
        run.step()
    assert run.admitted == [high, normal, low]


def test_an_idle_tenant_does_not_save_up_credit():
    run = Run(max_num_seqs=2)
    for _ in range(20):
        run.batcher.add(request("b"))
    for _ in range(40):
        run.step()
    # b has been served a lot; now a arrives with a backlog and b goes quiet for a while.
    for _ in range(50):
        run.batcher.add(request("a"))
    for _ in range(200):
        run.step()
    start = len(run.admitted)
    for _ in range(10):
        run.batcher.add(request("b"))
    for _ in range(60):
        run.step()
    later = [s.tenant for s in run.admitted[start:]]
    # b starts at the current virtual clock, not at the time it had when it went idle: the two
    # share the slots rather than b running alone until it "catches up" on its idle time.
    assert "a" in later[:6] and "b" in later[:6], later


def test_a_preempted_request_keeps_its_place_of_arrival():
    queue = FairQueue()
    first, second = request("a"), request("a")
    queue.add(first)
    queue.add(second)
    assert queue.pop() is first
    queue.add(first)  # preempted: back in the queue
    assert queue.peek() is first and len(queue) == 2
    queue.remove(second)
    assert list(queue) == [first] and second not in queue


def test_a_request_waiting_for_its_grammar_is_passed_over_and_keeps_its_place():
    queue = FairQueue()
    building, behind, other = request("a"), request("a"), request("b")
    building.status = Status.WAITING_FOR_GRAMMAR
    for seq in (building, behind, other):
        queue.add(seq)
    assert queue.pop() is behind  # its own tenant's next goes instead
    queue.charge(other, 100)  # b has had more than a, but a's one request left waits for its grammar
    assert queue.pop() is other
    assert queue.peek() is None and len(queue) == 1 and building in queue
    later = request("a")
    queue.add(later)
    building.status = Status.WAITING  # its matcher is ready: ahead of what arrived after it
    assert queue.pop() is building and queue.pop() is later


def test_a_better_service_tier_goes_first_across_tenants_whatever_their_shares():
    """Tenant b has had far less than its share, but its flex requests wait behind a's priority
    and default ones; within a tier, fair share still decides."""
    run = Run(max_num_seqs=1)
    for _ in range(5):
        run.batcher.add(request("a"))
    for _ in range(10):
        run.step()  # a has run: its virtual time is well ahead of b's
    flex_b, default_b = request("b", tier="flex"), request("b")
    prio_a, default_a = request("a", tier="priority"), request("a")
    for seq in (flex_b, default_a, default_b, prio_a):
        run.batcher.add(seq)
    while flex_b not in run.admitted:
        run.step()
    order = [s for s in run.admitted if s in (flex_b, default_b, prio_a, default_a)]
    assert order == [prio_a, default_b, default_a, flex_b], [s.id for s in order]
