"""The continuous-batching engine: one step is schedule, propose, run, postprocess.

The batcher picks each step's requests and token counts, the speculator (when on) puts
proposed tokens on decodes, the paged runner runs them all in one forward, and postprocess
samples each request's next tokens, settles what the cache holds and decides whether each
request ends. A finished or cancelled request leaves the batch at once and its slot is
refilled next step.

Only the model thread touches the batcher and the requests in it. The event loop hands new
requests and cancels over through inboxes, drained at the start of each step, and reads the
engine's state from views the step leaves behind.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from shared.messages import FinishReason, RequestPayload, TokenEvent, now
from shared.prefix_scope import PER_TENANT, PrefixScope
from shared.tokenizer import Tokenizer
from worker.engine.backend import Counts
from worker.engine.batcher import Batcher
from worker.model.batch import SchedulerOutput
from worker.engine.block_manager import ChainBlock
from worker.model.model_runner import PagedRunner
from worker.engine.base import BaseEngine
from worker.engine.execution_plan import ExecutionPlan, paged_plan
from worker.engine.kv_tier import KVTier
from worker.model.lora import Adapters
from worker.engine import pooling
from worker.engine.pooling import PoolJob
from worker.engine.random_streams import make_generator, replay_draws
from worker.engine.sampler import SamplingBatch, SamplingRow, sample_each
from worker.engine.sequence import Sequence, Status, StepOutput, new_sequence
from worker.engine.speculation import SpecStats, Speculator
from worker.engine.structured import Compiler, Grammars
from worker.engine.vision import ImageEncoder, Images


# How long a step waits for the grammar builds of new requests before it runs without those
# still under way: long enough for a burst's usual builds (0.2-0.6 ms each), short against a step.
BUILD_WAIT_S = 0.005
IDLE_BUILD_WAIT_S = 0.02
# Where a step's time goes, summed over the engine's life (Engine.phase_seconds, the worker's
# streamq:step_phase_seconds): taking in the requests and cancels that arrived; scheduling (batcher,
# speculation's proposals, the sampling batch); the model's forward; sampling, stop checks and detokenizing.
STEP_PHASES = ("arrivals", "schedule", "forward", "sample")


class Engine(BaseEngine):
    pools = True
    lora = True

    def __init__(self, runner: PagedRunner, tokenizer: Tokenizer, batcher: Batcher,
                 speculator: Speculator | None = None, tier: KVTier | None = None, scope: PrefixScope = PER_TENANT,
                 images: ImageEncoder | None = None):
        super().__init__(batcher.max_num_seqs)
        self.images = images  # a vision-language model's tower and projector (worker/engine/vision.py)
        self.scope = scope  # whose cached prefixes a request may reuse: its tenant's (shared/prefix_scope.py)
        self.runner = runner
        self.speculator = speculator
        self.tier = tier  # the shared KV tier, where on: blocks offloaded as filled, fetched on a miss
        self.tokenizer = tokenizer
        self.batcher = batcher
        self.compiler = Compiler(Grammars(tokenizer, runner.vocab_size))
        # The grammar's masks are computed while the model runs where it runs on an accelerator.
        # On the CPU they would compete with the model's own threads: measured on 2 cores, W all
        # under a schema ran at 0.89 of free that way, 0.95 with the masks after the forward.
        self.overlap_masks = runner.device.type != "cpu"
        self.mask_pool = ThreadPoolExecutor(1, thread_name_prefix="masks")  # its thread starts at the first mask
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self._sampling: dict[str, SamplingRow] = {}  # each taken-in request's sampling state
        self._arrivals: list[Sequence] = []  # added since the last step began
        self._arrivals_lock = threading.Lock()
        self._running: list[Sequence] = []  # views of the batcher as the last step left it
        self._waiting: list[Sequence] = []
        self._pool_arrivals: list[PoolJob] = []  # pooling requests (embeddings, rerank) added since the last step
        self._pools: list[PoolJob] = []  # ... and those the steps run, oldest first (model thread only)
        self._shares = pooling.Shares()  # which of their inputs run next: tenants' fair shares

    # -- called from the asyncio side ------------------------------------------------------
    @property
    def takes_images(self) -> bool:
        return self.images is not None

    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = (), images: list[bytes] = ()
            ) -> Sequence | PoolJob:
        if payload.pool is not None:  # it answers at its end only: a takeover starts it again
            job = PoolJob.of(payload)
            with self._arrivals_lock:
                self._pool_arrivals.append(job)
            return job
        seq = new_sequence(payload, self.tokenizer.decode, resumed, self.tokenizer.decode_stream)
        seq.images = list(images)
        if self.compiler.start(seq):
            seq.status = Status.WAITING_FOR_GRAMMAR
        with self._arrivals_lock:
            self._arrivals.append(seq)
        return seq

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def plan(self) -> ExecutionPlan:
        return paged_plan(self.runner)

    @property
    def batch_invariant(self) -> bool:
        return self.runner.batch_invariant

    @property
    def weight_bytes(self) -> int | None:
        return self.runner.weight_bytes()

    @property
    def adapters(self) -> Adapters | None:
        return self.runner.adapters

    @property
    def waiting(self) -> list[Sequence | PoolJob]:
        """Requests taken and not in the batch: generations, and pooling requests not done yet."""
        with self._arrivals_lock:
            return self._waiting + self._arrivals + self._pools + self._pool_arrivals

    @property
    def free_slots(self) -> int:
        """Requests to take from the queue now: just enough to fill the batch. The rest stay
        queued in Redis (truthfully 'queued', and free for another worker to take)."""
        return max(0, self.batch_size - len(self._running) - len(self.waiting))

    def kv_blocks(self) -> tuple[int, int]:
        """(free, total) KV-cache blocks."""
        blocks = self.batcher.blocks
        return blocks.num_free, len(blocks.blocks)

    def counts(self) -> Counts:
        blocks, stats = self.batcher.blocks, self.speculator.stats if self.speculator else SpecStats()
        return Counts(blocks.prefix_queries, blocks.prefix_hits, self.batcher.num_preemptions,
                      stats.drafts, stats.proposed, stats.accepted, self.tier.counts if self.tier else None)

    # -- one step, run in the model thread -------------------------------------------------
    def step(self) -> list[StepOutput]:
        clock = time.perf_counter
        began = clock()
        outputs = self._enqueue_arrivals() + self._end_cancelled() + self._pool_step()
        arrived = clock()
        scheduled = self.batcher.schedule()
        _stamp_first_step(scheduled)
        if self.speculator:
            self.speculator.propose(scheduled, self.batcher, self.runner.context_length, self._fitting)
        planned = forwarded = clock()
        if scheduled.chunks:
            batch = self._sampling_batch(scheduled)
            planned = clock()
            if self.overlap_masks:
                batch.start_masks(self.runner.vocab_size, self.mask_pool)  # while the model runs
            try:
                logits = self.runner.execute(scheduled, images=self._step_images(scheduled))
            finally:
                batch.settle_masks()  # a failed step's fail_all must find the matchers at rest
            self._offload()
            forwarded = clock()
            outputs += self._postprocess(scheduled, logits, batch)
        self._running, self._waiting = list(self.batcher.running), list(self.batcher.waiting)
        self.last_step_size = len(scheduled.chunks)
        ended = clock()
        for phase, seconds in zip(STEP_PHASES, (arrived - began, planned - arrived, forwarded - planned,
                                                ended - forwarded)):
            self.phase_seconds[phase] += seconds
        return outputs

    def fail_all(self, error: str) -> list[StepOutput]:
        outputs = super().fail_all(error)
        with self._arrivals_lock:
            jobs, self._pools, self._pool_arrivals = self._pools + self._pool_arrivals, [], []
        return outputs + [job.output(FinishReason.ERROR, error) for job in jobs]

    def _cancel(self, cancelled: set[str]) -> list[StepOutput]:
        """Pooling requests too: one cancelled between its inputs runs none of the rest."""
        outputs = super()._cancel(cancelled)
        with self._arrivals_lock:
            self._pool_arrivals, gone = pooling.split(self._pool_arrivals, cancelled)
        self._pools, stopped = pooling.split(self._pools, cancelled)
        return outputs + [job.output(FinishReason.CANCELLED) for job in gone + stopped]

    def _pool_step(self) -> list[StepOutput]:
        """Run the next pooling inputs (embeddings, rerank) that the token budget and the free
        blocks allow, in one forward before the step's own; end the requests now done. They wait
        while generation holds every block they need (it gives them back as requests end)."""
        with self._arrivals_lock:
            arrivals, self._pool_arrivals = self._pool_arrivals, []
        outputs, most = [], self.batcher.max_tokens_per_request()
        for job in arrivals:
            longest = max(map(job.length, range(job.size)))
            if job.task == "classify":  # the api sends it to cross-encoders only
                outputs.append(job.output(FinishReason.ERROR, "this model is a decoder, not a cross-encoder: "
                                                              "it has no classification head"))
            elif longest > most:
                outputs.append(job.output(FinishReason.ERROR, f"an input of {longest} tokens needs more KV cache "
                                                              f"than this worker's, which holds {most} tokens"))
            else:
                self._pools.append(job)
        picked = self._shares.pick(self._pools, self.batcher.max_num_batched_tokens, self.batcher.blocks)
        if not picked:
            return outputs
        stamp = now()
        for job, _ in picked:
            job.scheduled_at = job.scheduled_at or stamp
        pooling.run(picked, self.batcher.blocks, self.runner.execute)
        outputs += [job.output() for job in self._pools if job.done]
        self._pools = [job for job in self._pools if not job.done]
        return outputs

    def _running_or_waiting(self) -> list[Sequence]:
        return list(self.batcher.running) + list(self.batcher.waiting)

    def _held(self) -> list[Sequence]:
        return self._running_or_waiting() + self._take_arrivals()

    def _reset(self) -> None:
        self._running, self._waiting = [], []
        self.batcher.blocks.clear_prefix_cache()  # the failed step may have left them half written

    def _enqueue_arrivals(self) -> list[StepOutput]:
        """Requests added since the last step join the batcher's queue; a constrained one waits
        there as WAITING_FOR_GRAMMAR, passed over by the batcher, until its matcher is built.
        Each is made ready to run once (_ready), or ends here with an error."""
        idle = not self.batcher.has_work()
        arrivals = self._take_arrivals()
        for seq in arrivals:
            self.batcher.add(seq)
        building = [seq for seq in self.batcher.waiting if seq.status is Status.WAITING_FOR_GRAMMAR]
        if building:  # quick builds join this step; with nothing else to step, wait here, not in a spin
            self.compiler.wait(building, IDLE_BUILD_WAIT_S if idle else BUILD_WAIT_S)
        ready = [seq for seq in arrivals if seq.status is Status.WAITING]
        ready += [seq for seq in building if self.compiler.ready(seq)]
        ends = [self._ready(seq) for seq in ready]
        return [end for end in ends if end is not None]

    def _ready(self, seq: Sequence) -> StepOutput | None:
        """Give a queued request its matcher and sampling state and mark it WAITING, so the batcher
        may run it; or end it, with the error, where it cannot run (its constraint does not
        compile, it can never fit the cache, or its LoRA adapter is not served here)."""
        need, most = len(seq.prompt_ids) + (seq.params.max_tokens or 0), self.batcher.max_tokens_per_request()
        try:
            matcher = self.compiler.matcher(seq)
            if need > most:
                raise ValueError(f"the request needs {need} tokens of KV cache; this worker's cache holds {most}")
            seq.kv_root = self.scope.root(seq.tenant, self._hold_adapter(seq))
            if seq.images or seq.image_keys:
                if self.images is None:
                    raise ValueError("this worker's model takes no images")
                seq.vision = Images.of(seq.prompt_ids, self.images.vision, seq.image_keys, seq.images)
        except ValueError as exc:  # GrammarError included
            return self._end([seq], FinishReason.ERROR, str(exc))[0]
        self._fetch_prefix(seq)
        generator = make_generator(seq.params, self.runner.device)
        replay_draws(generator, self.runner.vocab_size, len(seq.output_ids))  # tokens delivered before a failover
        self._sampling[seq.id] = SamplingRow.of(seq, generator, matcher)
        seq.status = Status.WAITING
        return None

    def _hold_adapter(self, seq: Sequence) -> int | None:
        """The request's LoRA adapter, loaded if need be and held until it ends; its chain root
        (None for the base model), which keys the request's KV blocks apart from the base model's
        and other adapters' (a ValueError naming the adapter where this worker cannot serve it)."""
        if seq.adapter is None:
            return None
        adapters = self.runner.adapters
        if adapters is None:
            raise ValueError(f"adapter {seq.adapter!r}: this worker serves no LoRA adapters (STREAMQ_LORA_MODULES)")
        adapter = adapters.acquire(seq.adapter, seq.id, seq.adapter_revision, seq.adapter_path)
        seq.adapter_revision = adapter.revision
        return adapter.root

    def _fetch_prefix(self, seq: Sequence) -> None:
        """The blocks of the request's prefix that this worker's cache lacks, from the shared tier
        where it has them: they join the prefix cache, and the batcher's admission takes them."""
        if self.tier is None:
            return
        blocks = self.batcher.blocks
        # No more than are free: more would evict the first ones.
        missing = blocks.missing_prefix(seq.cache_ids, seq.kv_root)[:blocks.num_free]
        for link, kv in zip(missing, self.tier.fetch(missing)):
            self.runner.write_block(blocks.adopt(link), kv)

    def _offload(self) -> None:
        """The blocks this step's forward filled go to the shared tier (read out now: the next
        step's schedule may reuse a block)."""
        filled = self.batcher.blocks.take_filled()
        if self.tier is not None and filled and self.tier.accepting(len(filled)):
            for block in filled:
                self.tier.offload(ChainBlock(block.hash, *block.key), self.runner.read_block(block.id))

    def _step_images(self, scheduled: SchedulerOutput) -> tuple[list[int], torch.Tensor] | None:
        """The step's image-token rows (flat, in the step's order) and their embeddings, the
        images' from the encoder's cache or from one batched run of it; None without images."""
        wanted, places, row = [], [], 0
        for chunk in scheduled.chunks:
            seq, lo, hi = chunk.seq, chunk.start, chunk.start + chunk.length
            if seq.vision is not None:
                for key, (start, length), data in zip(seq.vision.keys, seq.vision.spans, seq.vision.data):
                    a, b = max(lo, start), min(hi, start + length)
                    if a < b:
                        places.append((row + a - lo, len(wanted), a - start, b - a))
                        wanted.append((seq.kv_root, key, data))
            row += len(chunk.input_ids)
        if not wanted:
            return None
        features = self.images.embeddings(wanted)
        rows = [r + i for r, _, _, n in places for i in range(n)]
        return rows, torch.cat([features[w][offset:offset + n] for _, w, offset, n in places])

    def _fitting(self, seq: Sequence, proposed: list[int]) -> int:
        """How many leading proposed tokens the request's grammar allows (all, without one)."""
        matcher = self._sampling[seq.id].matcher
        return len(proposed) if matcher is None else matcher.validate_tokens(proposed)

    def _take_arrivals(self) -> list[Sequence]:
        with self._arrivals_lock:
            arrivals, self._arrivals = self._arrivals, []
        return arrivals

    def _forget(self, seq: Sequence) -> None:
        self.compiler.discard(seq)
        self.batcher.remove(seq)
        self._sampling.pop(seq.id, None)
        if self.speculator:
            self.speculator.forget(seq.id)
        if self.runner.adapters is not None:
            self.runner.adapters.release(seq.id)

    def _sampling_batch(self, scheduled: SchedulerOutput) -> SamplingBatch:
        sampling = [c for c in scheduled.chunks if c.samples]
        return SamplingBatch([self._sampling[c.seq.id] for c in sampling], [c.draft for c in sampling],
                             [c.draft_probs for c in sampling])

    def _postprocess(self, scheduled: SchedulerOutput, logits: torch.Tensor, batch: SamplingBatch) -> list[StepOutput]:
        """Sample each sampling chunk's tokens; record what the cache holds now; emit the tokens
        and end the requests that are done."""
        sampling = [c for c in scheduled.chunks if c.samples]
        picked = dict(zip(map(id, sampling), sample_each(logits, batch)))
        outputs = []
        for chunk in scheduled.chunks:
            seq, result = chunk.seq, picked.get(id(chunk), ([], []))
            if isinstance(result, Exception):  # its own parameters broke its sampling: it alone fails
                self.batcher.computed(chunk)
                outputs.append(self._sampling_failed(seq, result))
                continue
            tokens, logprobs = result
            kept = max(0, len(tokens) - 1) if chunk.draft else 0  # every emitted token but the last was proposed
            self.batcher.computed(chunk, kept)
            if chunk.draft:
                self.speculator.settle(chunk, kept)
            for token, lp in zip(tokens, logprobs):
                outputs.append(self._emit(seq, token, lp))
                if seq.finished:
                    break
        return outputs


def _stamp_first_step(scheduled: SchedulerOutput) -> None:
    """When each request's first step here began (its queue time ends there)."""
    stamp = now()
    for chunk in scheduled.chunks:
        if chunk.seq.scheduled_at is None:
            chunk.seq.scheduled_at = stamp
