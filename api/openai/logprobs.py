"""OpenAI's usage and logprobs objects, from a reply's token events."""
from __future__ import annotations

from shared.messages import FinalEvent, TokenEvent
from shared.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, tokens: list[TokenEvent], offset: int) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = token_text(tokenizer, t.token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(_by_text(tokenizer, t.top_logprobs or []))
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def _by_text(tokenizer: Tokenizer, top: list) -> dict[str, float]:
    """The likeliest tokens keyed by their text, as OpenAI's legacy shape has them; of two ids with
    one text (a byte token's replacement character), the likelier keeps the entry."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(token_text(tokenizer, token_id), logprob)
    return out


def echo_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], scored: list, top: int) -> dict:
    """The prompt's part of an echoed completion's logprobs (OpenAI's legacy shape): every prompt
    token, the first with no logprob (nothing comes before it); `scored`, the others' PromptLogprob
    (api/openai/pooling/inputs.py), of which the `top` likeliest tokens are given."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for k, token_id in enumerate(prompt_ids):
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if k == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            entry = scored[k - 1]
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(_by_text(tokenizer, entry.top[:top]))
    return out


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], scored: list, top: int) -> list:
    """vLLM's choices[].prompt_logprobs: None for the first token, then for each token a map of token
    id to {logprob, rank, decoded_token}: the token itself and the `top` likeliest there."""
    out: list = [None]
    for token_id, entry in zip(prompt_ids[1:], scored):
        ranks = {i: (lp, r + 1) for r, (i, lp) in enumerate(entry.top[:top])}
        ranks[token_id] = (entry.logprob, entry.rank)
        out.append({str(i): {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, i)}
                    for i, (lp, rank) in ranks.items()})
    return out


def chat_logprobs(tokenizer: Tokenizer, tokens: list[TokenEvent]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs or []]}
                        for t in tokens]}


def usage(prompt_tokens: int, completion_tokens: int, *finals: list[FinalEvent | None]) -> dict:
    """OpenAI's usage; its cached_tokens are the prompt tokens a worker took from a cache (the
    prefix cache or the shared KV tier): for each prompt, the most of its samples (`finals`: each
    prompt's samples' final events), added over the prompts."""
    cached = sum(max((f.usage.cached_tokens for f in group if f is not None), default=0) for group in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
