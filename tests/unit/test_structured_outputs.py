"""Structured outputs: the constraint's validation (shared/structured.py) and the engine's masks
(worker/engine/structured.py), on the tiny llama model, whose random weights would write anything."""
from __future__ import annotations

import json
import re
import threading

import pytest
from pydantic import ValidationError

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared.sampling import SamplingParams
from shared.structured import StructuredOutputs, verdict
from tests.unit.test_engine import NEW_TOKENS, make_engine, prompts, run
from worker.engine.sequence import Status

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["Paris", "Seoul", "Lyon"]


def _valid(obj: object) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "tags", "ok"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 8 and type(obj["age"]) is int and type(obj["ok"]) is bool
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b"})


@pytest.mark.parametrize("body", [{"json": SCHEMA}, {"json_object": True}, {"regex": REGEX}, {"choice": CHOICES},
                                  {"grammar": 'root ::= "yes" | "no"'}, {"grammar": 'start: "x"+'}])
def test_each_form_of_constraint_compiles(body):
    constraint = StructuredOutputs.model_validate(body)
    assert constraint.grammar_text() and constraint.compile_error() == ""


@pytest.mark.parametrize("body, names", [
    ({"json": {"type": "nonsense"}}, "json"), ({"regex": "[0-9"}, "regex"), ({"grammar": "root ::= (("}, "grammar"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, "json")])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_form(body, names):
    """Reading the body compiles nothing (the api compiles in its grammar pool, api/core/grammar_pool.py):
    the verdict, as the pool's processes give it, names the form."""
    constraint = StructuredOutputs.model_validate(body)
    assert constraint.compile_error().startswith(f"{names}: ")
    assert verdict(constraint.model_dump_json(by_alias=True, exclude_none=True)) == constraint.compile_error()


@pytest.mark.parametrize("body, names", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "regex, choice"), ({"choice": []}, "choice"),
    ({"json": {"enum": ["x" * 70_000]}}, "longer than")])
def test_a_body_that_is_no_single_constraint_is_refused_as_it_is_read(body, names):
    with pytest.raises(ValidationError) as info:
        StructuredOutputs.model_validate(body)
    assert names in str(info.value)


def test_constrained_and_free_requests_share_a_batch_and_the_free_ones_are_untouched(tiny_llama):
    texts = prompts(6, seed=11)
    alone = run(make_engine(tiny_llama), texts)
    engine = make_engine(tiny_llama)
    tok = engine.tokenizer
    payloads = []
    for i, text in enumerate(texts):  # free and constrained requests alternate in one batch
        form = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}][i % 3]
        payloads += [_payload(f"f{i}", tok.encode(text)),
                     _payload(f"c{i}", tok.encode(text), structured_outputs=form, max_tokens=120)]
    out = engine.generate(payloads)
    free, constrained = out[0::2], out[1::2]
    assert [s.output_ids for s in free] == [s.output_ids for s in alone]
    for i, seq in enumerate(constrained):
        text = tok.decode(seq.output_ids)
        assert seq.finish_reason is FinishReason.STOP, (i, text)
        if i % 3 == 0:
            assert _valid(json.loads(text)), text
        elif i % 3 == 1:
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES


def test_sampled_constrained_requests_obey_too(tiny_llama):
    engine = make_engine(tiny_llama)
    seqs = engine.generate([_payload(f"s{seed}", engine.tokenizer.encode("hi"), temperature=1.5, seed=seed,
                                     structured_outputs={"json": SCHEMA}, max_tokens=120) for seed in range(4)])
    for seq in seqs:
        assert seq.finish_reason is FinishReason.STOP and _valid(json.loads(engine.tokenizer.decode(seq.output_ids)))


def test_json_is_written_without_free_whitespace(tiny_llama):
    engine = make_engine(tiny_llama)
    [seq] = engine.generate([_payload("j", engine.tokenizer.encode("go"), structured_outputs={"json": SCHEMA},
                                      max_tokens=120)])
    text = engine.tokenizer.decode(seq.output_ids)
    assert text == json.dumps(json.loads(text), ensure_ascii=False)


def test_a_continued_request_replays_its_delivered_tokens_into_the_grammar(tiny_llama):
    """A worker taking over a constrained request after k tokens gives the undisturbed run's."""
    params = {"structured_outputs": {"json": SCHEMA}, "max_tokens": 120}
    engine = make_engine(tiny_llama)
    prompt = engine.tokenizer.encode("the capital of")
    [whole] = engine.generate([_payload("w", prompt, **params)])
    for k in (1, 4, len(whole.output_ids) // 2):
        engine = make_engine(tiny_llama)
        delivered = [TokenEvent(index=i, token_id=t, text="") for i, t in enumerate(whole.output_ids[:k])]
        [seq] = engine.generate([_payload(f"k{k}", prompt, **params)], resumed=[delivered])
        assert seq.output_ids == whole.output_ids, k


def test_a_payload_whose_delivered_tokens_break_the_grammar_ends_with_an_error(tiny_llama):
    engine = make_engine(tiny_llama)
    tok = engine.tokenizer
    delivered = [TokenEvent(index=0, token_id=tok.encode("x")[-1], text="x")]  # JSON cannot start with x
    seq, free = engine.generate([_payload("bad", tok.encode("hi"), structured_outputs={"json_object": True}),
                                 _payload("free", tok.encode("hi"))], resumed=[delivered, []])
    assert seq.finish_reason is FinishReason.ERROR and "constraint" in seq.error
    assert free.finish_reason is not FinishReason.ERROR and free.output_ids


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}])
def test_proposals_under_a_constraint_keep_the_output_exact(tiny_llama, sampling):
    """Speculation on constrained requests emits the plain constrained run's tokens, greedy and
    seeded. The oracle proposes each request's true next 2 tokens and then wrong ones: those the
    grammar forbids are cut before the model scores them, the others the sampler rejects."""
    from tests.unit.test_speculative_engine import Oracle
    from worker.engine.speculation import Speculator

    params = {"structured_outputs": {"json": SCHEMA}, "max_tokens": 120, **sampling}
    texts = prompts(4, seed=12)
    plain = run(make_engine(tiny_llama), texts, **params)
    engine = make_engine(tiny_llama)
    engine.speculator = Speculator(Oracle({s.id: s.output_ids for s in plain}, right=2), 4)
    spec = run(engine, texts, **params)
    stats = engine.speculator.stats
    assert stats.accepted > 0 and stats.forbidden > 0 and stats.proposed > stats.accepted
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert all(_valid(json.loads(engine.tokenizer.decode(s.output_ids))) for s in spec)


def test_prompt_lookup_speeds_a_constrained_request_and_keeps_it_exact(tiny_llama):
    from worker.engine.speculation import NgramProposer, Speculator

    text = "a b c a b c a b c a b c"
    outputs, stats = [], None
    for speculate in (False, True):
        engine = make_engine(tiny_llama)
        if speculate:
            engine.speculator = Speculator(NgramProposer(4, 1, 3), 4, 0)
        [seq] = engine.generate([_payload("c", engine.tokenizer.encode(text), structured_outputs={"regex": "(a b c )+"},
                                          max_tokens=40)])
        outputs.append(seq.output_ids)
        stats = engine.speculator.stats if speculate else None
    assert stats.accepted > 0 and outputs[1] == outputs[0]
    assert re.fullmatch("(a b c )*(a ?|a b ?|a b c)?", engine.tokenizer.decode(outputs[1]))  # max_tokens may cut it


def test_the_masks_are_computed_while_the_model_runs(tiny_llama, monkeypatch):
    """With the overlap on (an accelerator's way), each step's masks are asked for once, on the
    mask thread the step starts before its forward, never again in the sampler; the output is
    that of masks computed after the forward (the CPU's way)."""
    import worker.engine.sampler as sampler

    texts = prompts(3, seed=14)
    params = {"structured_outputs": {"json": SCHEMA}, "max_tokens": 40}
    inline = make_engine(tiny_llama)
    assert not inline.overlap_masks  # on the CPU the masks wait for the forward
    # sampled with masks computed in the sampler itself
    inline_seqs = inline.generate([_payload(f"r{i}", inline.tokenizer.encode(text), **params)
                                   for i, text in enumerate(texts)])

    calls, forwards = [], []
    real_allowed = sampler.allowed
    monkeypatch.setattr(sampler, "allowed",
                        lambda *a: calls.append(threading.current_thread().name) or real_allowed(*a))
    engine = make_engine(tiny_llama)
    engine.overlap_masks = True  # as on an accelerator
    execute = engine.runner.execute
    engine.runner.execute = lambda scheduled, **kw: forwards.append(len(calls)) or execute(scheduled, **kw)
    overlapped = engine.generate([_payload(f"r{i}", engine.tokenizer.encode(text), **params)
                                  for i, text in enumerate(texts)])
    assert [s.output_ids for s in overlapped] == [s.output_ids for s in inline_seqs]
    assert calls and all(name.startswith("masks") for name in calls)
    assert len(calls) == len(forwards)  # one mask computation a step, none again in the sampler


def _gated(engine) -> threading.Event:
    """Hold every grammar build of the engine until the returned event is set."""
    gate, build = threading.Event(), engine.compiler.grammars.matcher

    def held(params, delivered):
        gate.wait(120)  # bounded, so a failing test cannot hang the run
        return build(params, delivered)

    engine.compiler.grammars.matcher = held
    return gate


def test_a_grammar_that_takes_long_to_build_holds_up_no_step(tiny_llama):
    engine = make_engine(tiny_llama)
    gate = _gated(engine)
    tok = engine.tokenizer
    try:
        held = _add(engine, "held", tok.encode("hi"), structured_outputs={"regex": REGEX})
        cancelled = _add(engine, "cancelled", tok.encode("hi"), structured_outputs={"json_object": True})
        free = _add(engine, "free", tok.encode("hello"))
        assert held.status is cancelled.status is Status.WAITING_FOR_GRAMMAR and free.status is Status.WAITING
        engine.step()
        assert free.status is Status.RUNNING and cancelled.status is Status.WAITING_FOR_GRAMMAR
        assert cancelled in engine.batcher.waiting  # queued, passed over
        engine.cancel("cancelled")
        while not free.finished:  # the free request runs to its end while both builds are held
            engine.step()
        assert free.finish_reason is not FinishReason.ERROR and free.output_ids
        assert cancelled.finish_reason is FinishReason.CANCELLED and cancelled not in engine.batcher.waiting
        assert held.output_ids == [] and held.status is Status.WAITING_FOR_GRAMMAR and held in engine.waiting
    finally:
        gate.set()
    statuses = []
    while engine.has_work() and len(statuses) < 200:  # bounded: a request never marked WAITING would step forever
        engine.step()
        statuses.append(held.status)
    changes = [status for i, status in enumerate(statuses) if not i or status is not statuses[i - 1]]
    # Built (now, or after a slow build's next steps), it is marked WAITING and admitted in one step.
    assert changes in ([Status.RUNNING, Status.FINISHED], [Status.WAITING_FOR_GRAMMAR, Status.RUNNING, Status.FINISHED])
    assert held.finish_reason is FinishReason.STOP and re.fullmatch(REGEX, tok.decode(held.output_ids))


def test_a_grammar_past_its_time_limit_fails_its_request_alone(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.compiler.timeout_s = 0.0
    gate = _gated(engine)
    try:
        late = _add(engine, "late", engine.tokenizer.encode("hi"), structured_outputs={"regex": REGEX})
        free = _add(engine, "free", engine.tokenizer.encode("hi"))
        assert late.status is Status.WAITING_FOR_GRAMMAR
        while engine.has_work():
            engine.step()
    finally:
        gate.set()
    assert late.finish_reason is FinishReason.ERROR and "longer than 0 s to compile" in late.error
    assert late.status is Status.FINISHED and late not in engine.batcher.waiting
    assert free.finish_reason is not FinishReason.ERROR and free.output_ids


def _payload(rid: str, prompt_ids: list[int], **params) -> RequestPayload:
    p = SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, **params})
    return RequestPayload(id=rid, model="m", prompt_token_ids=prompt_ids, params=p)


def _add(engine, rid: str, prompt_ids: list[int], resumed=(), **params):
    return engine.add(_payload(rid, prompt_ids, **params), list(resumed))


def test_the_static_engine_follows_constraints_too(tiny_llama):
    from tests.unit.test_broken_rows import static

    engine = static(tiny_llama)
    tok = engine.tokenizer
    bad = [TokenEvent(index=0, token_id=tok.encode("x")[-1], text="x")]
    *seqs, broken = engine.generate([
        _payload("j", tok.encode("hi"), structured_outputs={"json": SCHEMA}, max_tokens=120),
        _payload("r", tok.encode("hi"), structured_outputs={"regex": REGEX}, max_tokens=40),
        _payload("f", tok.encode("hi")),
        _payload("b", tok.encode("hi"), structured_outputs={"json_object": True})], resumed=[[], [], [], bad])
    assert _valid(json.loads(tok.decode(seqs[0].output_ids))) and seqs[0].finish_reason is FinishReason.STOP
    assert re.fullmatch(REGEX, tok.decode(seqs[1].output_ids))
    assert seqs[2].output_ids and seqs[2].finish_reason is not FinishReason.ERROR
    assert broken.finish_reason is FinishReason.ERROR


@pytest.mark.parametrize("form, answer", [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}, '{"a": 1}'),
    ({"json_object": True}, '{"b": 2}'), ({"regex": "[a-z]{3}"}, "abc"), ({"choice": ["yes", "no"]}, "yes"),
    ({"grammar": 'start: "x" "y"'}, "xy"),
])
def test_every_form_holds_after_a_free_thought(tiny_llama, form, answer):
    """after_thought (a thinking model's chat): any text up to the end tag, then the constraint; the
    thought the prompt opened is not optional, one the model opens itself is."""
    from llguidance import LLMatcher
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ll = llguidance.hf.from_tokenizer(tok)

    def fits(constraint: StructuredOutputs, text: str) -> bool:
        matcher = LLMatcher(ll, constraint.grammar_text())
        return all(matcher.consume_token(t) for t in tok(text, add_special_tokens=False).input_ids) \
            and matcher.is_accepting()

    opened = StructuredOutputs.model_validate({**form, "after_thought": {"close": "</think>"}})
    optional = StructuredOutputs.model_validate({**form, "after_thought": {"open": "<think>", "close": "</think>"}})
    assert opened.compile_error() == "" and optional.compile_error() == ""
    assert fits(opened, "Free text, even {braces} and </thin</think>" + answer)
    assert not fits(opened, answer) and not fits(opened, "a thought</think>" + answer + "!")
    assert fits(optional, answer) and fits(optional, "<think>hmm</think>" + answer)


def test_a_client_cannot_set_after_thought():
    from api.openai.schemas import ChatCompletionRequest

    with pytest.raises(ValidationError, match="after_thought is the server's"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {
            "regex": "a", "after_thought": {"close": "</think>"}}})
