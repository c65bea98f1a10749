"""Pick the next token of every sampling request of a step, each with its own parameters.

Order, as in vLLM: logit bias and logits processors, penalties, temperature, then min_p,
top_k and top_p, then one draw from each request's own random stream (so the same seed
gives the same sample whatever else is in the batch). Greedy rows take the argmax after the
bias and penalties. Log-probabilities are those of the model's raw distribution.
"""
from __future__ import annotations

import torch

from shared.sampling import SamplingParams
from worker.sequence import Logprobs, Sequence


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request random stream: the same seed gives the same sample whatever the batch."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    return generator


def sample_batch(logits: torch.Tensor, seqs: list[Sequence],
                 generators: list[torch.Generator | None]) -> tuple[list[int], list[Logprobs | None]]:
    """Next token of each row of `logits` ([rows, vocab]) for the matching request."""
    params = [s.payload.params for s in seqs]
    raw = logits.float()
    x = raw
    if any(p.logit_bias or p.logits_processors or p.needs_history for p in params):
        x = raw.clone()
        for row, (seq, p) in enumerate(zip(seqs, params)):
            _adjust(x[row], seq, p)
    tokens = x.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=x.device)
        probs = _filtered_probs(x[rows], [params[i] for i in sampled])
        for j, i in enumerate(sampled):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    token_list = tokens.tolist()
    return token_list, _logprobs(raw, token_list, params)


def _adjust(row: torch.Tensor, seq: Sequence, p: SamplingParams) -> None:
    """Bias, processors and penalties, in place on one row of logits."""
    vocab = row.shape[0]
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long, device=row.device)
        row[ids] += torch.tensor([p.logit_bias[t] for t in ids.tolist()], device=row.device)
    for proc in p.logits_processors:
        banned = [t for t in proc.token_ids if 0 <= t < vocab]
        row[banned] = float("-inf")
    if p.needs_history:
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if seq.output_ids and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(seq.output_ids, device=row.device), minlength=vocab)[:vocab]
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


def _logprobs(raw: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[Logprobs | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[Logprobs | None] = [None] * len(params)
    if not wanted:
        return out
    logp = torch.log_softmax(raw[wanted], dim=-1)
    k = max(params[i].logprobs for i in wanted)
    top_values, top_ids = logp.topk(max(k, 1), dim=-1)
    for j, i in enumerate(wanted):
        n = params[i].logprobs
        out[i] = Logprobs(float(logp[j, tokens[i]]),
                          list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist())))
    return out
