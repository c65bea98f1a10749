"""The slowest constraints we know how to write under the api's limits: what each costs to
validate (the api), to build as a matcher (the worker, on its Compiler thread) and per mask.

    .venv/bin/python benchmarks/grammar_worst.py

With the default model's tokenizer. Each matcher then takes 30 tokens along a random allowed
path, and the slowest of those masks is reported. Prints one table row per constraint, after
the CPU's model and flags (docs/structured_outputs.md, "Compile time, worst cases").
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llguidance import LLMatcher, LLTokenizer
from pydantic import ValidationError

from shared.model_paths import prepare_model
from shared.settings import CommonSettings
from shared.structured import StructuredOutputs
from shared.tokenizer import Tokenizer


def constraints(rng: random.Random) -> dict[str, dict]:
    def words(n: int, length: int, letters: str = "abcdefghij") -> list[str]:
        return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(n)]
    return {
        "small object schema": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "regex (a|b)*a(a|b){40} (exponential DFA)": {"regex": "(a|b)*a(a|b){40}"},
        "choice of 256 strings of 200 chars": {"choice": words(256, 200, "abcdefgh")},
        "900 properties, each with a pattern": {"json": {"type": "object", "properties": {
            w: {"type": "string", "pattern": "(a|b)*a(a|b){8}c"} for w in words(900, 12)}}},
        "an enum of 4,000 strings": {"json": {"enum": words(4000, 12)}},
        "an ambiguous Lark grammar": {"grammar": 'start: x\nx: x x | "a" | x "a" x\n'},
    }


def worst_mask(matcher: LLMatcher, vocab: int, rng: random.Random, steps: int = 30) -> float:
    worst = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        mask = matcher.compute_bitmask()
        worst = max(worst, time.perf_counter() - start)
        words = memoryview(mask).cast("I")
        allowed = [t for t in range(vocab) if words[t // 32] >> (t % 32) & 1]
        if not allowed or matcher.is_stopped() or not matcher.consume_token(rng.choice(allowed)):
            break
    return worst


def main() -> None:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    print("\n".join(line for line in lscpu if line.startswith(("Model name", "Flags"))))
    tok = Tokenizer(prepare_model(CommonSettings()))
    ll = LLTokenizer(tok.rust_tokenizer().to_str(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids))
    rng = random.Random(0)
    print("| constraint | chars | api validate | matcher build | worst mask |\n|---|---|---|---|---|")
    for name, body in constraints(rng).items():
        chars = len(json.dumps(body))
        start = time.perf_counter()
        try:
            parsed = StructuredOutputs.model_validate(body)
        except ValidationError as exc:
            print(f"| {name} | {chars:,} | refused: {exc.errors()[0]['msg'][:60]} | | |")
            continue
        if error := parsed.compile_error():  # what the api's grammar pool runs
            print(f"| {name} | {chars:,} | refused: {error[:60]} | | |")
            continue
        validate = time.perf_counter() - start
        start = time.perf_counter()
        matcher = LLMatcher(ll, parsed.grammar_text(), log_level=0)
        build = time.perf_counter() - start
        mask = worst_mask(matcher, tok.vocab_size, rng)
        print(f"| {name} | {chars:,} | {validate * 1e3:.0f} ms | {build * 1e3:.0f} ms | {mask * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
