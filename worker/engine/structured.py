"""Structured outputs in the worker: one llguidance matcher per constrained request.

A request's constraint (shared/structured.py) becomes a matcher when the request joins the
batch; a request continued from another worker first replays the tokens already delivered.
Each step the sampler asks every constrained row for its mask of allowed tokens, computed for
all of them in one call (llguidance's executor, on its own threads), and sets
the rest to -inf before anything else touches the logits (bias, penalties, temperature, top-k/p,
the argmax). After a token is chosen its matcher consumes it; when the grammar can take no
more tokens the request ends with finish reason `stop`. EOS is allowed exactly where the
grammar is complete. Free requests in the same batch pay nothing.
"""
from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import cache
from typing import TYPE_CHECKING

import torch

from shared.messages import FinishReason
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """The constraint does not compile (the api checks this first; a payload may skip the api)."""


class Grammars:
    """The worker's llguidance tokenizer (built at the first constrained request) over the
    model's `vocab` logits; makes each request's matcher."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self._ll: LLTokenizer | None = None

    def _ll_tokenizer(self) -> LLTokenizer:
        if self._ll is None:
            from llguidance import LLTokenizer

            self._ll = LLTokenizer(self.tokenizer.rust_tokenizer().to_str(), n_vocab=self.vocab,
                                   eos_token=sorted(self.tokenizer.eos_token_ids))
        return self._ll

    def matcher(self, params: SamplingParams, delivered: list[int]) -> LLMatcher | None:
        """The request's matcher, past the tokens `delivered` already; None when it has no
        constraint. GrammarError when the constraint does not compile or the tokens break it."""
        if params.structured_outputs is None:
            return None
        from llguidance import LLMatcher

        try:
            grammar = params.structured_outputs.grammar_text()
        except ValueError as exc:
            raise GrammarError(str(exc)) from exc
        matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if delivered and not matcher.consume_tokens(delivered):
            raise GrammarError(f"the delivered tokens do not fit the constraint: {matcher.get_error()}")
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher


class Compiler:
    """Builds each constrained request's matcher on a thread of its own, so a grammar that takes
    long to build never holds up the step loop: the request joins the batch at the first step
    after its matcher is ready, and one not ready within `timeout_s` fails alone. (llguidance
    bounds each build and each mask by its fuel limits as well.)"""

    def __init__(self, grammars: Grammars, timeout_s: float = 30.0):
        self.grammars, self.timeout_s = grammars, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._jobs: dict[str, tuple[Future, float]] = {}  # request id -> (its build, its deadline)

    def start(self, seq: Sequence) -> bool:
        """Begin the request's build (any thread; before the model thread can see the request);
        whether it has one (a constraint)."""
        params = seq.params
        if params.structured_outputs is None:
            return False
        build = self._pool.submit(self.grammars.matcher, params, list(seq.output_ids))
        self._jobs[seq.id] = (build, time.monotonic() + self.timeout_s)
        return True

    def ready(self, seq: Sequence) -> bool:
        """Whether the request can join the batch now (its build is done, failed or late)."""
        job = self._jobs.get(seq.id)
        return job is None or job[0].done() or time.monotonic() >= job[1]

    def wait(self, seqs: list[Sequence], most_s: float) -> None:
        """Block until every one of the requests' builds is done, or `most_s` passes. A step
        waits a few milliseconds, so that a burst's quick builds join it; a step loop with
        nothing else to run waits longer rather than spin."""
        jobs = [self._jobs[seq.id] for seq in seqs if seq.id in self._jobs]  # only this thread pops them
        pending = [(build, deadline) for build, deadline in jobs if not build.done()]
        if pending:
            timeout = min(most_s, max(0.0, min(deadline for _, deadline in pending) - time.monotonic()))
            wait([build for build, _ in pending], timeout, return_when=ALL_COMPLETED)

    def matcher(self, seq: Sequence) -> LLMatcher | None:
        """A ready request's matcher (None without a constraint); GrammarError when the build
        failed or ran past the time limit."""
        job = self._jobs.pop(seq.id, None)
        if job is None:
            return None
        build, _ = job
        if not build.done():
            build.cancel()  # a build under way runs to its end; its result is dropped
            raise GrammarError(f"the constraint took longer than {self.timeout_s:g} s to compile")
        return build.result()

    def discard(self, seq: Sequence) -> None:
        if (job := self._jobs.pop(seq.id, None)) is not None:
            job[0].cancel()


def allowed(constraints: list[tuple[LLMatcher, list[int]]], vocab: int) -> torch.Tensor:
    """[sum(1 + len(draft)), vocab] bool: for each (matcher, proposed tokens), the tokens it
    allows next, then after each proposed token in turn (the matcher is left where it was).
    Computed together, on llguidance's threads. Every proposed token must fit the grammar
    (the speculator cuts a proposal at the first one that does not)."""
    from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

    words = (vocab + 31) // 32
    rows, plain, drafted = 0, [], []
    for matcher, draft in constraints:
        if draft:
            drafted.append((matcher, rows, list(draft)))
        else:
            plain.append((matcher, rows))
        rows += 1 + len(draft)
    bitmask = torch.zeros((rows, words), dtype=torch.int32)
    if plain:
        fill_next_token_bitmask_par(_executor(), plain, bitmask)
    if drafted:  # llguidance takes no empty proposal here
        fill_next_token_bitmask_par_with_draft_tokens(_executor(), drafted, bitmask)
    # Token t is bit t % 32 of word t // 32; on a little-endian CPU, bit t % 8 of byte t // 8,
    # and bytes unpack with a quarter of the words' traffic.
    octets = bitmask.view(torch.uint8) if sys.byteorder == "little" else None
    if octets is None:
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    else:
        bits = (octets.unsqueeze(-1) >> _BITS) & 1
    return bits.view(rows, words * 32)[:, :vocab].bool()


_BITS = torch.arange(8, dtype=torch.uint8)


@cache
def _executor() -> LLExecutor:
    from llguidance import LLExecutor

    return LLExecutor(max(1, torch.get_num_threads()))


def follow_grammar(seq: Sequence, matcher: LLMatcher, token: int) -> None:
    """The request's matcher takes its new token; a grammar that is complete and can take no more
    ends the request (finish reason stop). A token the matcher refuses (the mask allowed it, so
    a failure of llguidance's own) ends it with an error."""
    if not matcher.consume_token(token):
        if not seq.finished:
            seq.finish(FinishReason.ERROR, f"token {token} does not fit the constraint: {matcher.get_error()}")
    elif matcher.is_stopped() and not seq.finished:
        seq.finish(FinishReason.STOP)
