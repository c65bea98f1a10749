"""Pooling requests (embeddings, rerank scores) in the paged engine: each input's prompt runs
through the model once, in the same steps as generation, and answers a vector or a score.

Quantized projections compute with fp32 activations here, also where generation rounds them to
int8 (worker/model/quant_linear.py float_activations). An input is prefilled whole into cache blocks of
its own (no prefix-cache sharing: a mean needs every token's hidden state, which a cached prefix
would skip), and its blocks go back as soon as its forward ends. A step runs the next pooled
inputs that its token budget and the free blocks allow in one forward of their own, then its
generation batch (Engine._pool_step): streams go on while a batch is embedded.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field

import torch

from shared.messages import FinishReason, RequestPayload
from shared import service_tier
from shared.queue import lane_of
from worker.model.batch import Chunk, SchedulerOutput
from worker.engine.block_manager import BlockManager
from worker.model.quant_linear import float_activations
from worker.engine.sequence import RequestEnd, StepOutput


@dataclass(eq=False)
class PoolJob:
    """One pooling request in the engine: its inputs and the results computed so far. Input i's
    prompt is `head` + bodies[i] + `tail`, put together only as it runs (a rerank's query lies in
    `tail` once, however many documents it scores)."""

    id: str
    task: str  # embed | score | classify | logprobs (shared.messages.PoolSpec)
    bodies: list[list[int]]
    normalize: bool
    candidates: list[int] | None
    created_at: float
    lane: str
    head: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    skips: list[int] = field(default_factory=list)  # an encoder's embed: each input's prompt tokens left out of pooling
    top: int = 0  # logprobs: the most likely tokens given at each position
    results: list[str] = field(default_factory=list)  # base64 float32, one per input done, in order
    scheduled_at: float | None = None
    tenant: str = ""  # for its tenant's fair share of the steps (Shares)
    weight: float = 1.0
    priority: int = 0
    tier: int = service_tier.RANK["default"]

    @classmethod
    def of(cls, payload: RequestPayload) -> PoolJob:
        spec = payload.pool
        return cls(payload.id, spec.task, payload.pool_inputs(), spec.normalize, spec.candidates,
                   payload.created_at, lane_of(payload), spec.head, spec.tail, spec.skips, spec.top,
                   tenant=payload.tenant, weight=payload.weight, priority=payload.priority,
                   tier=service_tier.RANK[payload.service_tier])

    @property
    def size(self) -> int:
        """Its inputs."""
        return len(self.bodies)

    def length(self, i: int) -> int:
        """Input i's prompt tokens."""
        return len(self.head) + len(self.bodies[i]) + len(self.tail)

    def tokens(self, i: int) -> list[int]:
        """Input i's prompt."""
        return self.head + self.bodies[i] + self.tail

    @property
    def done(self) -> bool:
        return len(self.results) == self.size

    @property
    def num_tokens(self) -> int:
        return sum(self.length(i) for i in range(self.size))

    def put(self, value: torch.Tensor) -> None:
        """The next input's result."""
        self.results.append(encode_floats(value))

    def take(self, rows: torch.Tensor) -> None:
        """The next input's result from its rows of the step's output: every token's final hidden
        state (embed), its last token's logits (score), or every token's logits (logprobs)."""
        if self.task == "logprobs":
            value = prompt_logprobs(rows, self.tokens(len(self.results)), self.top)
        elif self.task == "embed":
            value = rows.float().mean(dim=0)
            if self.normalize:
                value = torch.nn.functional.normalize(value, dim=0)
        else:
            yes, no = rows[-1, self.candidates].float()
            value = torch.sigmoid(yes - no).reshape(1)  # = softmax over the two candidates, first one's
        self.put(value)

    def output(self, reason: FinishReason = FinishReason.STOP, error: str | None = None) -> StepOutput:
        """Its end, with the results where it is done."""
        pooled = tuple(self.results) if reason is FinishReason.STOP and error is None else None
        end = RequestEnd(reason, error, "", self.num_tokens, 0, pooled=pooled)
        return StepOutput(self.id, None, True, self.created_at, self.scheduled_at, self.lane, end)


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> torch.Tensor:
    """Each prompt token's logprob given the tokens before it (the first has none), its rank, and
    the `top` most likely tokens there: rows of (logprob, rank, id_1, logprob_1, ... id_top,
    logprob_top), flattened (token ids are exact in float32 below 2**24)."""
    if len(tokens) < 2:
        return torch.empty(0)
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    actual = torch.tensor(tokens[1:], device=logprobs.device)
    chosen = logprobs.gather(1, actual[:, None])
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    columns = [chosen, rank.float()]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        columns.append(torch.stack([ids.float(), values], dim=-1).flatten(1))
    return torch.cat(columns, dim=1).flatten()


def split(jobs: list[PoolJob], ids: set[str]) -> tuple[list[PoolJob], list[PoolJob]]:
    """(the jobs kept, those whose id is in `ids`): what a cancel takes out, in either engine."""
    return [job for job in jobs if job.id not in ids], [job for job in jobs if job.id in ids]


def encode_floats(values: torch.Tensor) -> str:
    return base64.b64encode(values.detach().to("cpu", torch.float32).numpy().astype("<f4").tobytes()).decode()


class Shares:
    """Which pooling inputs run next, as the fair queue orders generations (worker/engine/fair_queue.py):
    by service tier, then in weighted fair share between tenants, within a tenant by priority, then
    arrival. Each tenant has a virtual time, the pooled tokens run for it over its weight; the next
    input is the next one of the tenant with the least, so one tenant's rerank of 256 documents
    shares every step with another's single embedding rather than going first whole. A tenant that
    was idle starts at the current clock: idleness is not saved up as credit. Model thread only."""

    def __init__(self) -> None:
        self._vtime: dict[str, float] = {}
        self._clock = 0.0
        self._busy: set[str] = set()  # tenants with inputs left at the last pick

    def pick(self, jobs: list[PoolJob], max_tokens: int, blocks: BlockManager | None = None
             ) -> list[tuple[PoolJob, int]]:
        """The next forward's inputs, of one task (a forward gives hidden states or logits), as the
        step's token budget and the free cache blocks (the paged engine's) allow: always the first,
        however long, where its blocks are free. `jobs` in arrival order; a job's inputs go in order."""
        queues: dict[str, list[PoolJob]] = {}
        for job in sorted((j for j in jobs if not j.done), key=lambda j: j.priority):  # stable: then arrival
            queues.setdefault(job.tenant, []).append(job)
        for tenant in queues.keys() - self._busy:
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), self._clock)
        self._busy = set(queues)
        following = {id(job): len(job.results) for jobs_ in queues.values() for job in jobs_}
        picked: list[tuple[PoolJob, int]] = []
        tokens = needed = 0
        while queues:
            tenant = min(queues, key=lambda t: (min(j.tier for j in queues[t]), self._vtime[t], t))
            queue = queues[tenant]
            job = next((j for j in queue if not picked or j.task == picked[0][0].task), None)
            if job is None:  # only inputs of another task: for a later forward
                del queues[tenant]
                continue
            i, n = following[id(job)], job.length(following[id(job)])
            more = -(-n // blocks.block_size) if blocks is not None else 0
            if (blocks is not None and needed + more > blocks.num_free) or (picked and tokens + n > max_tokens):
                break
            picked.append((job, i))
            tokens, needed = tokens + n, needed + more
            self._clock = max(self._clock, self._vtime[tenant])
            self._vtime[tenant] += n / job.weight
            following[id(job)] += 1
            if following[id(job)] == job.size:
                queue.remove(job)
                if not queue:
                    del queues[tenant]
        return picked


def run(picked: list[tuple[PoolJob, int]], blocks: BlockManager, execute) -> None:
    """Run the picked inputs in one forward (`execute`: PagedRunner.execute) on blocks of their
    own, given back at once, and hand each job its results."""
    chunks, ids = [], []
    for job, i in picked:
        tokens, seq_id = job.tokens(i), f"pool:{job.id}:{i}"
        blocks.append_slots(seq_id, len(tokens))
        ids.append(seq_id)
        rows = len(tokens) if job.task in ("embed", "logprobs") else 1
        chunks.append(Chunk(None, 0, list(tokens), blocks.table(seq_id), rows))
    try:
        with float_activations():  # not int8-rounded: an embedding or a score is read as a value
            out = execute(SchedulerOutput(chunks), hidden=picked[0][0].task == "embed")
    finally:
        for seq_id in ids:
            blocks.truncate(seq_id, 0)  # never registered: first in line for reuse
            blocks.free(seq_id)
    start = 0
    for (job, _), chunk in zip(picked, chunks):
        job.take(out[start:start + chunk.num_logits])
        start += chunk.num_logits
