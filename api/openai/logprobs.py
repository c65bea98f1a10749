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
        out["top_logprobs"].append({token_text(tokenizer, i): lp for i, lp in t.top_logprobs or []})
        out["text_offset"].append(offset)
        offset += len(t.text)
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
