"""Pick the next token of every sampling request of a step, each with its own parameters (the
speculative acceptance rules are worker/engine/acceptance.py's, the random streams
worker/engine/random_streams.py's, a draft model's proposals worker/engine/drafter.py's).

Order, as in vLLM: the structured-outputs mask, logit bias and logits processors, penalties,
temperature, then min_p, top_k and top_p, then one draw from each request's own random stream
(so the same seed gives the same sample whatever else is in the batch). Greedy rows take the
argmax after the mask, bias and penalties. Log-probabilities are those of the model's raw
distribution.
"""
from __future__ import annotations

from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.sampling import SamplingParams
from worker.engine.acceptance import accept_greedy, sample_draft, sample_lookup
from worker.engine.sequence import Logprobs, Sequence
from worker.engine.structured import allowed


@dataclass
class SamplingRow:
    """One request's sampling state, made when it joins the batch: its parameters, its own
    random stream, and its tokens (read, not copied, for the penalties)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # prompt then output
    output_ids: list[int]
    matcher: Any = None  # its structured-outputs constraint (an llguidance matcher; worker/engine/structured.py)
    detokenizer: Any = None  # its text so far (whether it ends inside a character: a budget waits then)

    @classmethod
    def of(cls, seq: Sequence, generator: torch.Generator | None, matcher: Any = None) -> SamplingRow:
        return cls(seq.params, generator, seq.token_ids, seq.output_ids, matcher, seq.detokenizer)


@dataclass
class SamplingBatch:
    """What the sampler needs of one step, one entry per sampling request in the step's order:
    its SamplingRow, and the tokens proposed after its known ones (with the proposer's
    distributions over them, for a draft model) that this step verifies."""

    rows: list[SamplingRow]
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    masks: Future | None = None  # the constrained rows' masks, under way since before the forward

    def __post_init__(self) -> None:
        self.drafts = self.drafts or [[] for _ in self.rows]
        self.draft_probs = self.draft_probs or [None] * len(self.rows)

    def start_masks(self, vocab: int, pool: Executor) -> None:
        """Compute the grammar's masks on `pool` while the model runs: they depend only on the
        tokens already chosen (and those proposed), never on this step's logits."""
        if constraints := self.constraints():
            self.masks = pool.submit(allowed, [(m, draft) for _, m, draft in constraints], vocab)

    def settle_masks(self) -> None:
        """Wait for the masks under way (their matchers are not to be touched meanwhile)."""
        if self.masks is not None:
            wait([self.masks])

    def __len__(self) -> int:
        return len(self.rows)

    def one(self, i: int) -> SamplingBatch:
        return SamplingBatch([self.rows[i]], [self.drafts[i]], [self.draft_probs[i]])

    def constraints(self) -> list[tuple[int, Any, list[int]]]:
        """(first logits row, matcher, proposed tokens) of each request under a constraint."""
        out, row = [], 0
        for req, draft in zip(self.rows, self.drafts):
            if req.matcher is not None:
                out.append((row, req.matcher, draft))
            row += 1 + len(draft)
        return out

    def logits_rows(self) -> list[SamplingRow]:
        """The request of each logits row: 1 + len(draft) rows a request."""
        return [r for r, d in zip(self.rows, self.drafts) for _ in range(1 + len(d))]


def sample_verify(logits: torch.Tensor, batch: SamplingBatch) -> list[tuple[list[int], list[Logprobs | None]]]:
    """The tokens each request emits this step, with their log-probabilities.

    Request i owns 1 + len(batch.drafts[i]) consecutive rows of `logits`: the model's scores
    after its known tokens, then after each proposed token. With nothing proposed this is plain
    sampling. Greedy keeps the agreeing prefix and the model's next token. Sampling draws each
    position from the model's own distribution p with the request's random stream and goes on
    while the draw equals the proposal: for a proposal made with certainty (prompt lookup) this
    is the rejection rule exactly, and it emits what plain seeded sampling would. A draft
    model's proposal x, drawn from its q (`batch.draft_probs[i]`, one row per proposed token), is
    kept with probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
    max(0, p - q), renormalised. Either way the output is distributed as the model's.
    """
    row_of = batch.logits_rows()
    raw, choices, probs = scores(logits, row_of, batch.constraints(), batch.masks)
    emitted, rows, row = [], [], 0
    for req, draft, q in zip(batch.rows, batch.drafts, batch.draft_probs):
        if req.params.greedy:
            tokens = accept_greedy(draft, choices[row:row + len(draft) + 1])
        elif q is None:
            tokens = sample_lookup(draft, [probs[r] for r in range(row, row + len(draft) + 1)], req.generator)
        else:
            tokens = sample_draft(draft, [probs[r] for r in range(row, row + len(draft) + 1)], q, req.generator)
        emitted.append(tokens)
        rows += range(row, row + len(tokens))  # emitted token j was chosen from row + j
        row += len(draft) + 1
    flat = [t for tokens in emitted for t in tokens]
    logprobs = iter(_logprobs(raw, rows, flat, [row_of[r].params for r in rows]))
    return [(tokens, [next(logprobs) for _ in tokens]) for tokens in emitted]


def sample_each(logits: torch.Tensor,
                batch: SamplingBatch) -> list[tuple[list[int], list[Logprobs | None]] | Exception]:
    """sample_verify, but a request whose sampling raises gets its exception instead of tokens,
    and every other request exactly the tokens it would have had without it.

    The batched pass runs first; only when it raises is each request sampled alone, after its
    random stream is rewound to where the batched pass found it (so no draw is taken twice).
    """
    states = [None if r.generator is None else r.generator.get_state() for r in batch.rows]
    try:
        return sample_verify(logits, batch)
    except Exception:  # noqa: BLE001 - found again, and kept, row by row below
        batch.settle_masks()  # each row computes its own mask again below
    out: list[tuple[list[int], list[Logprobs | None]] | Exception] = []
    row = 0
    for i, (req, state) in enumerate(zip(batch.rows, states)):
        if req.generator is not None:
            req.generator.set_state(state)
        width = 1 + len(batch.drafts[i])
        rows = logits[row:row + width]
        row += width
        try:
            out.append(sample_verify(rows, batch.one(i))[0])
        except Exception as exc:  # noqa: BLE001 - this request's parameters broke its own sampling
            out.append(exc)
    return out


def scores(logits: torch.Tensor, row_of: list[SamplingRow], constraints: list[tuple[int, Any, list[int]]],
           masks: Future | None = None) -> tuple[torch.Tensor, list[int], dict[int, torch.Tensor]]:
    """Per row (of the request `row_of[row]`): the raw logits as float, the argmax after the
    grammar's mask, bias, processors and penalties, and for sampled requests' rows the filtered
    distribution. `constraints`: (first row, matcher, proposed tokens) of each constrained request;
    `masks`: their masks, when computed already (allowed's result, under way)."""
    params = [r.params for r in row_of]
    constrained = [first + j for first, _, draft in constraints for j in range(1 + len(draft))]
    adjusted = any(p.logit_bias or p.logits_processors or p.needs_history for p in params)
    # A greedy batch with nothing to adjust takes its argmax on the logits as they come (bf16 to
    # fp32 is exact, so the choice is the same) and never copies the batch's [rows, vocab] to fp32.
    plain = not adjusted and all(p.greedy and p.logprobs is None for p in params)
    raw = logits if plain else logits.float()
    # Masks and adjustments go on a copy (in the logits' own dtype for a plain batch), the raw
    # logits kept for log-probabilities.
    x = raw.clone() if constrained or adjusted else raw
    if constrained:
        ok = (masks.result() if masks is not None
              else allowed([(matcher, draft) for _, matcher, draft in constraints], x.shape[-1])).to(x.device)
        if len(constrained) == x.shape[0]:
            x.masked_fill_(~ok, float("-inf"))
        else:
            rows = torch.tensor(constrained, device=x.device)
            x[rows] = x[rows].masked_fill(~ok, float("-inf"))
    if adjusted:
        for row, req in enumerate(row_of):
            _adjust(x[row], req)  # a request with penalties is never given proposals: one row each
    # max's indices: the first maximal one, as argmax's, and 2-3x faster over a vocabulary here.
    choices = x.max(dim=-1).indices.tolist()
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        return raw, choices, {}
    filtered = _filtered_probs(x[torch.tensor(sampled, device=x.device)], [params[row] for row in sampled])
    return raw, choices, {row: filtered[j] for j, row in enumerate(sampled)}


def _adjust(row: torch.Tensor, req: SamplingRow) -> None:
    """Bias, processors and penalties, in place on one row of logits."""
    vocab, p = row.shape[0], req.params
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long, device=row.device)
        row[ids] += torch.tensor([p.logit_bias[t] for t in ids.tolist()], device=row.device)
    for proc in p.logits_processors:
        banned = [t for t in proc.token_ids if 0 <= t < vocab]
        row[banned] = float("-inf")
    if (p.thinking_budget is not None and (forced := p.thinking_budget.forced(req.output_ids)) is not None
            and not (req.detokenizer is not None and req.detokenizer.mid_character)):  # a character's bytes first
        if 0 <= forced < vocab:  # the thought's budget is spent: its end tag, whatever the logits say
            row[torch.arange(vocab, device=row.device) != forced] = float("-inf")
            row[forced] = 0.0
        return
    if p.needs_history:
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if req.output_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(req.output_ids, device=row.device), minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top_k and top_p for the sampled rows, vectorised."""
    dev = x.device
    temps = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    probs = torch.softmax(x / temps, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    vocab = x.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # Keep the first k, and the smallest set reaching top_p (the most likely token always stays).
    drop = (rank >= top_k) | ((mass_before >= top_p) & (rank > 0))
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    # A row the arithmetic broke (inf/nan logits) keeps only its best token, so one request's
    # odd parameters can never fail the draw for the whole batch.
    broken = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    if broken.any():
        best = torch.nan_to_num(x[broken], nan=float("-inf")).argmax(dim=-1, keepdim=True)
        probs[broken] = torch.zeros_like(probs[broken]).scatter_(-1, best, 1.0)
    return probs


def _logprobs(raw: torch.Tensor, rows: list[int], tokens: list[int],
              params: list[SamplingParams]) -> list[Logprobs | None]:
    """Token i's log-probability (and the top alternatives) from row rows[i] of the raw logits."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[Logprobs | None] = [None] * len(params)
    if not wanted:
        return out
    logp = torch.log_softmax(raw[[rows[i] for i in wanted]], dim=-1)
    k = max(params[i].logprobs for i in wanted)
    top_values, top_ids = logp.topk(max(k, 1), dim=-1)
    for j, i in enumerate(wanted):
        n = params[i].logprobs
        out[i] = Logprobs(float(logp[j, tokens[i]]),
                          list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())))
    return out
