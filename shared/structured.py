"""Structured outputs: a constraint on what a request may generate, as one grammar.

A request carries at most one of a JSON schema, "any JSON object", a regular expression, a
list of choices or a grammar (Lark, or GBNF as llama.cpp writes it), as vLLM's
`structured_outputs` does. The worker turns it into llguidance's grammar and masks, each step,
the tokens the grammar does not allow (worker/engine/structured.py), so the output obeys it whatever
the model's quality. Validating the body checks only what is cheap (one form, the size caps); the
api compiles the grammar once the request is admitted, in its grammar pool's processes under a time
cap (api/core/grammar_pool.py, `verdict`), so a schema, regex or grammar that llguidance cannot
compile is a 400 naming the field, never a failed generation, and no compile runs on its event loop.

llguidance, not xgrammar: it has no dependencies (xgrammar pulls triton and a TVM runtime into
a CPU install), it takes all five forms, GBNF included, and it computes each mask on the fly
in tens of microseconds without compiling the grammar against the whole vocabulary first, so
a new schema costs no compile step; vLLM runs it as its `guidance` backend.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_GRAMMAR_CHARS = 64_000
MAX_CHOICES = 256


# JSON is written as Python's json.dumps writes it ("a": 1, "b": 2), with no other whitespace: a
# free run of spaces and newlines is where a weak model wanders until max_tokens, unfinished.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

FORMS = ("json_schema", "json_object", "regex", "choice", "grammar")


class ThoughtPrefix(BaseModel):
    """A thinking model's thought before the constraint applies: free text up to `close` (its
    end-of-thought tag), where the prompt opened it (`open` empty), or opened by the model with
    `open` and optional; the constraint holds from there on (Generation.payloads sets it)."""

    model_config = ConfigDict(extra="forbid")

    open: str = Field("", max_length=64)
    close: str = Field(min_length=1, max_length=64)


class StructuredOutputs(BaseModel):
    """Exactly one of the constraint's forms."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json",
                                               description="A JSON schema the output validates against.")
    json_object: bool | None = Field(None, description="true: the output is a JSON object.")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS,
                              description="A regular expression (Rust regex syntax).")
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                     description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, description="A Lark or GBNF grammar.")
    # Set by the api for a thinking model's chat, never by a client (the body's schemas leave it out)
    after_thought: ThoughtPrefix | None = Field(None, description="Set by the server: the thought stays free.")

    @model_validator(mode="after")
    def _one_form_within_the_caps(self) -> StructuredOutputs:
        given = [name for name in FORMS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice and grammar"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.json_schema is not None and len(json.dumps(self.json_schema)) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the JSON schema is longer than {MAX_GRAMMAR_CHARS} characters")
        return self

    @property
    def form(self) -> str:
        return next(name for name in FORMS if getattr(self, name) not in (None, False))

    def compile_error(self) -> str:
        """llguidance's verdict on this constraint: '' when it compiles, else the reason, naming the
        form as the body spells it. CPU work (up to llguidance's fuel limits): the api runs it in its
        grammar pool, never on its event loop."""
        try:
            error = compile_error(self.grammar_text())
        except (ValueError, RuntimeError) as exc:  # a schema that is not JSON, GBNF that does not convert
            error = str(exc)
        return f"{'json' if self.form == 'json_schema' else self.form}: {error}" if error else ""

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar (ValueError where it cannot be built); after a
        free thought where `after_thought` says so."""
        inner = self._form_grammar()
        return inner if self.after_thought is None else _after_thought(inner, self.after_thought)

    def _form_grammar(self) -> str:
        from llguidance import LLMatcher, grammar_from

        if self.json_schema is not None:
            return LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_LAYOUT)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(self.choice))
        return grammar_from("grammar", self.grammar or "")


def _after_thought(inner: str, prefix: ThoughtPrefix) -> str:
    """`inner` (llguidance's grammar: Lark text, or its JSON of grammars) after a thought: a lazy
    run of any text up to the first end-of-thought tag, then the inner grammar, referenced by name."""
    grammars = json.loads(inner)["grammars"] if inner.lstrip().startswith("{") else [{"lark_grammar": inner}]
    thought = f"thought[lazy]: THOUGHT_TEXT {json.dumps(prefix.close)}\nTHOUGHT_TEXT: /(.|\\n)*/\n"
    start = ("start: thought @constrained\n" if not prefix.open
             else f"start: ({json.dumps(prefix.open)} thought)? @constrained\n")
    return json.dumps({"grammars": [{"lark_grammar": start + thought}, {**grammars[0], "name": "constrained"},
                                    *grammars[1:]]})


def compile_error(grammar: str) -> str:
    """llguidance's verdict on a grammar ('' when it compiles). Not cached here: a process-wide
    cache would answer one tenant's schema faster because another sent it (a timing side channel);
    the api's grammar pool keeps verdicts per tenant. llguidance's fuel limits bound a build; the
    slowest measured here, a 60,000-character schema of 900 patterned properties, took 140 ms
    (docs/structured_outputs.md)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def verdict(constraint: str) -> str:
    """`StructuredOutputs.compile_error` of a constraint sent as its JSON (by alias): what the api's
    grammar pool runs in its processes, strings in and out."""
    return StructuredOutputs.model_validate_json(constraint).compile_error()
