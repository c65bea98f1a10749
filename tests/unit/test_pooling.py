"""Pooling requests (embeddings, rerank scores) in the paged engine, in-process on the tiny models,
against transformers on the same weights: on the CPU kernels (where this CPU has them), on the
portable path (the kernels' portable ISA), and on the eager ops."""
from __future__ import annotations

import base64
import functools

import numpy as np
import pytest
import torch

from shared.messages import FinishReason, PoolSpec, RequestPayload
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner
from worker.engine.pooling import PoolJob, Shares

TEXTS = ["the cat sat on the mat", "a", "streams of tokens flow through the cache of many workers at once",
         "embeddings are the mean of the last hidden states", "Paris is the capital of France"]


@functools.cache
def _reference_model(folder: str, causal: bool):
    from transformers import AutoModel, AutoModelForCausalLM

    kind = AutoModelForCausalLM if causal else AutoModel
    return kind.from_pretrained(folder, dtype=torch.float32).eval()


def reference_embedding(folder, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        hidden = _reference_model(str(folder), False)(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).numpy()


def reference_score(folder, ids: list[int], yes: int, no: int) -> float:
    with torch.no_grad():
        logits = _reference_model(str(folder), True)(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits[[yes, no]], dim=0)[0].item()


def make_engine(folder, path: str, num_blocks=64, block_size=4, budget=32) -> Engine:
    model = load_model(folder, torch.device("cpu"), torch.float32)
    ops = None if path == "eager" else kernels.load()
    if path == "portable":
        ops = kernels.with_isa(ops, "portable")
    runner = PagedRunner(model, torch.device("cpu"), num_blocks, block_size, ops)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(num_blocks, block_size), 8, budget))


def pool_payload(rid: str, inputs: list[list[int]], **spec) -> RequestPayload:
    return RequestPayload(id=rid, model="m", prompt_token_ids=[t for ids in inputs for t in ids],
                          params=SamplingParams(max_tokens=1),
                          pool=PoolSpec(lengths=[len(ids) for ids in inputs], **spec))


def drain(engine: Engine) -> dict:
    ends = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                ends[out.request_id] = out.end
    return ends


def floats(encoded: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(encoded), dtype="<f4")


@pytest.fixture(params=["llama", "opt"])
def model_dir(request, tiny_llama, tiny_opt):
    return tiny_llama if request.param == "llama" else tiny_opt


@pytest.mark.parametrize("path", ["kernels", "portable", "eager"])
def test_embeddings_equal_transformers_mean_pooled_hidden_states(model_dir, path):
    if path != "eager" and model_dir.name.endswith("opt"):
        pytest.skip("the kernels run the llama-family layers only")
    engine = make_engine(model_dir, path)
    inputs = [engine.tokenizer.encode(t) for t in TEXTS]
    engine.add(pool_payload("e", inputs, task="embed"))
    end = drain(engine)["e"]
    assert end.finish_reason is FinishReason.STOP and end.prompt_tokens == sum(map(len, inputs))
    assert len(end.pooled) == len(inputs)
    for ids, got in zip(inputs, end.pooled):
        want = reference_embedding(model_dir, ids)
        vector = floats(got)
        assert vector.shape == want.shape
        assert float(np.dot(vector, want)) >= 0.9999  # both unit length: the cosine
        np.testing.assert_allclose(vector, want, atol=1e-4)


def test_scores_equal_transformers_yes_no_probability(tiny_llama):
    engine = make_engine(tiny_llama, "kernels")
    inputs = [engine.tokenizer.encode(t) for t in TEXTS]
    yes, no = 5, 9
    engine.add(pool_payload("s", inputs, task="score", candidates=[yes, no]))
    end = drain(engine)["s"]
    for ids, got in zip(inputs, end.pooled):
        assert floats(got)[0] == pytest.approx(reference_score(tiny_llama, ids, yes, no), abs=1e-5)


def test_unnormalized_embeddings_keep_their_length(tiny_llama):
    engine = make_engine(tiny_llama, "eager")
    ids = engine.tokenizer.encode(TEXTS[0])
    engine.add(pool_payload("u", [ids], task="embed", normalize=False))
    vector = floats(drain(engine)["u"].pooled[0])
    with torch.no_grad():
        hidden = _reference_model(str(tiny_llama), False)(torch.tensor([ids])).last_hidden_state[0]
    np.testing.assert_allclose(vector, hidden.mean(dim=0).numpy(), atol=1e-4)


def test_pooling_beside_generation_changes_no_generated_token(tiny_llama):
    """Generation alone and with embeddings and scores in the same steps: the same greedy tokens,
    and every block the pooling took is back."""
    def generate(with_pooling: bool) -> list[int]:
        engine = make_engine(tiny_llama, "kernels", budget=16)
        tok = engine.tokenizer
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seq = engine.add(RequestPayload(id="g", model="m", prompt_token_ids=tok.encode(TEXTS[2]), params=params))
        if with_pooling:
            inputs = [tok.encode(t) for t in TEXTS]
            engine.add(pool_payload("e", inputs, task="embed"))
            engine.add(pool_payload("s", inputs, task="score", candidates=[1, 2]))
        ends = drain(engine)
        assert set(ends) == ({"g", "e", "s"} if with_pooling else {"g"})
        assert engine.batcher.blocks.num_free == len(engine.batcher.blocks.blocks)
        return seq.output_ids

    assert generate(True) == generate(False)


def test_an_input_longer_than_the_cache_fails_alone(tiny_llama):
    engine = make_engine(tiny_llama, "eager", num_blocks=4, block_size=4)
    tok = engine.tokenizer
    engine.add(pool_payload("long", [tok.encode(TEXTS[2] * 3)], task="embed"))
    engine.add(pool_payload("ok", [tok.encode(TEXTS[0])], task="embed"))
    ends = drain(engine)
    assert ends["long"].finish_reason is FinishReason.ERROR and "KV cache" in ends["long"].error
    assert ends["ok"].finish_reason is FinishReason.STOP and len(ends["ok"].pooled) == 1


def test_plan_keeps_to_the_budget_the_free_blocks_and_one_task():
    blocks = BlockManager(num_blocks=6, block_size=4)
    embed = PoolJob.of(pool_payload("e", [[1] * 8, [2] * 8, [3] * 8], task="embed"))
    score = PoolJob.of(pool_payload("s", [[1] * 3], task="score", candidates=[1, 2]))
    pick = Shares().pick
    picked = pick([embed, score], 12, blocks)
    assert [(job.id, i) for job, i in picked] == [("e", 0)]  # a second input would pass 12 tokens
    picked = pick([embed, score], 100, blocks)
    assert [(job.id, i) for job, i in picked] == [("e", 0), ("e", 1), ("e", 2)]  # 6 blocks; not the score
    assert pick([score, embed], 100, blocks)[0][0] is score
    blocks.append_slots("busy", 24)
    assert pick([embed], 100, blocks) == []  # waits for blocks


@pytest.mark.parametrize("isa", ["auto", "portable"])
def test_quantized_weights_pool_with_float_activations(tiny_llama, isa):
    """The weights kept quantized (4- and 8-bit) on the kernels this CPU runs (auto: VNNI's int8
    activations where it has them, which generation keeps) and on the portable path: embeddings and
    scores are those of the same model with the weights dequantized to floats."""
    from worker.model.quantized import quantize

    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    model = load_model(tiny_llama, torch.device("cpu"), torch.float32)
    twin = load_model(tiny_llama, torch.device("cpu"), torch.float32)
    for layer, twin_layer in zip(model.model.layers, twin.model.layers):
        for name in names:
            module = layer.get_submodule(name)
            q = quantize(module.weight.data, 4 if "attn" in name else 8, 16 if "mlp" in name else 32)
            twin_layer.get_submodule(name).weight.data = q.dequantize()
            module.quantized = q
    ops = kernels.with_isa(kernels.load(), isa)
    results = []
    for m in (model, twin):
        engine = Engine(PagedRunner(m, torch.device("cpu"), 64, 4, ops), Tokenizer(tiny_llama),
                        Batcher(BlockManager(64, 4), 8, 32))
        inputs = [engine.tokenizer.encode(t) for t in TEXTS]
        engine.add(pool_payload("e", inputs, task="embed"))
        engine.add(pool_payload("s", inputs, task="score", candidates=[5, 9]))
        ends = drain(engine)
        results.append(([floats(v) for v in ends["e"].pooled], [floats(v)[0] for v in ends["s"].pooled]))
    (vectors, scores), (want_vectors, want_scores) = results
    for got, want in zip(vectors, want_vectors):
        assert float(np.dot(got, want)) >= 0.9999
    assert scores == pytest.approx(want_scores, abs=1e-4)


def test_a_pool_head_and_tail_score_as_the_whole_prompts(tiny_llama):
    """Inputs queued without the head and tail they share (a rerank's template and query, once)
    score as the whole prompts do, and count every token of them."""
    engine = make_engine(tiny_llama, "eager")
    tok = engine.tokenizer
    head, tail = tok.encode("Document:"), tok.encode("\nQuestion: where is Paris?", add_special_tokens=False)
    bodies = [tok.encode(" " + t, add_special_tokens=False) for t in TEXTS]
    shared = pool_payload("h", bodies, task="score", candidates=[5, 9], head=head, tail=tail)
    assert shared.num_prompt_tokens == shared.cost_tokens == sum(len(head + b + tail) for b in bodies)
    engine.add(shared)
    engine.add(pool_payload("w", [head + b + tail for b in bodies], task="score", candidates=[5, 9]))
    ends = drain(engine)
    assert ends["h"].pooled == ends["w"].pooled and ends["h"].prompt_tokens == ends["w"].prompt_tokens


def test_a_cancelled_pooling_request_stops_between_its_inputs(tiny_llama):
    """A cancel heard between steps ends the request there: cancelled, no results, the inputs left
    never run, and every block back."""
    engine = make_engine(tiny_llama, "eager", budget=8)
    tok = engine.tokenizer
    engine.add(pool_payload("c", [tok.encode(t) for t in TEXTS * 4], task="embed"))
    engine.add(pool_payload("queued", [tok.encode(TEXTS[0])], task="embed"))
    assert not [out for out in engine.step() if out.finished]  # some inputs ran, not all
    engine.cancel("c")
    ends = {out.request_id: out.end for out in engine.step() if out.finished}
    assert ends["c"].finish_reason is FinishReason.CANCELLED and ends["c"].pooled is None
    ends.update(drain(engine))
    assert ends["queued"].finish_reason is FinishReason.STOP  # the other one goes on
    assert engine.batcher.blocks.num_free == len(engine.batcher.blocks.blocks)


@pytest.mark.parametrize("path", ["kernels", "portable", "eager"])
def test_prompt_logprobs_equal_transformers(model_dir, path):
    """task logprobs: each prompt token's logprob after the tokens before it, its rank, and the top
    k there, as transformers' log-softmax of the same logits gives them (fp32, within 1e-4)."""
    if path != "eager" and model_dir.name.endswith("opt"):
        pytest.skip("the kernels run the llama-family layers only")
    engine = make_engine(model_dir, path)
    inputs = [engine.tokenizer.encode(t) for t in TEXTS if len(engine.tokenizer.encode(t)) > 1]
    top = 3
    engine.add(pool_payload("lp", inputs, task="logprobs", top=top))
    end = drain(engine)["lp"]
    assert end.finish_reason is FinishReason.STOP and len(end.pooled) == len(inputs)
    for ids, got in zip(inputs, end.pooled):
        rows = floats(got).reshape(len(ids) - 1, 2 + 2 * top)
        with torch.no_grad():
            logits = _reference_model(str(model_dir), True)(torch.tensor([ids])).logits[0, :-1]
        want = torch.log_softmax(logits.float(), dim=-1)
        chosen = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        np.testing.assert_allclose(rows[:, 0], chosen.numpy(), atol=1e-4)
        np.testing.assert_array_equal(rows[:, 1], ((want > chosen[:, None]).sum(dim=1) + 1).numpy())
        values, top_ids = want.topk(top, dim=-1)
        np.testing.assert_array_equal(rows[:, 2::2], top_ids.numpy())
        np.testing.assert_allclose(rows[:, 3::2], values.numpy(), atol=1e-4)


def _job(rid: str, inputs: int, tenant: str, length: int = 4, **extra) -> PoolJob:
    payload = pool_payload(rid, [[1] * length] * inputs, task="embed")
    return PoolJob.of(payload.model_copy(update={"tenant": tenant, **extra}))


def test_a_tenants_long_job_shares_each_step_with_another_tenants_input():
    """Tenant a's 64 inputs came first; b's one input, queued behind them, runs in the very next
    step (in arrival order it would wait for a's whole job), and a's inputs stay in order."""
    shares = Shares()
    flood, single = _job("flood", 64, "a"), _job("single", 1, "b")
    picked = shares.pick([flood, single], max_tokens=16)
    assert [(job.id, i) for job, i in picked] == [("flood", 0), ("single", 0), ("flood", 1), ("flood", 2)]


def test_tenants_share_by_weight_and_a_better_tier_goes_first():
    shares = Shares()
    heavy, light = _job("heavy", 30, "a", weight=3.0), _job("light", 30, "b")
    picked = shares.pick([light, heavy], max_tokens=4 * 16)
    assert sum(job is heavy for job, _ in picked) == 12 and sum(job is light for job, _ in picked) == 4
    flex, priority = _job("flex", 8, "a", service_tier="flex"), _job("prio", 2, "b", service_tier="priority")
    picked = Shares().pick([flex, priority], max_tokens=12)
    assert [job.id for job, _ in picked] == ["prio", "prio", "flex"]


def test_an_idle_tenant_saves_no_credit():
    """b was idle while a ran alone: when b comes, it starts at the clock, not at zero, so a is
    not shut out until b has caught up."""
    shares = Shares()
    alone = _job("alone", 40, "a")
    for _ in range(5):
        for job, _ in shares.pick([alone], max_tokens=16):
            job.results.append("")
    late = _job("late", 40, "b")
    picked = shares.pick([alone, late], max_tokens=32)
    assert {job.id for job, _ in picked} == {"alone", "late"}
