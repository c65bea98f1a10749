"""The encoder engine (worker/engine/encoder_engine.py) step by step, on a tiny random BERT: inputs
packed up to the token budget in arrival order, one result per input equal to the input run
alone, cancels between steps, and what it refuses (a generation, a task the model lacks)."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from shared.messages import FinishReason, PoolSpec, RequestPayload
from shared.pooling_model import describe
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_encoders import build_encoder
from worker.engine.encoder_engine import EncoderEngine
from worker.model.encoders import Packed, load

pytest.importorskip("sentence_transformers")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = build_encoder(tmp_path_factory.mktemp("bert"), "bert")
    return load(folder, describe(folder), CPU, torch.float32), Tokenizer(folder)


def _payload(rid: str, inputs: list[list[int]], task: str = "embed") -> RequestPayload:
    spec = PoolSpec(task=task, lengths=[len(x) for x in inputs], candidates=[1, 2] if task == "score" else None)
    return RequestPayload(id=rid, model="m", prompt_token_ids=[t for x in inputs for t in x],
                          params=SamplingParams(max_tokens=1), pool=spec)


def _vectors(end) -> np.ndarray:
    return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in end.pooled])


def test_inputs_pack_up_to_the_budget_in_arrival_order_and_equal_each_run_alone(encoder):
    model, tok = encoder
    texts = [f"text number {i} " + "word " * (i % 5) for i in range(7)]
    ids = [tok.encode(t) for t in texts]
    budget = 3 * max(map(len, ids))
    engine = EncoderEngine(model, tok, batch_size=8, max_num_batched_tokens=budget)
    engine.add(_payload("a", ids[:4]))
    engine.add(_payload("b", ids[4:]))
    sizes, ends = [], {}
    while engine.has_work():
        for out in engine.step():
            ends[out.request_id] = out.end
        sizes.append(engine.last_step_size)
    assert sum(sizes) == 7 and all(sizes) and len(sizes) >= -(-sum(map(len, ids)) // budget) > 1  # the budget split them
    alone = np.stack([model.embed(Packed.of([(x, len(x))], CPU), [0])[0].numpy() for x in ids])
    got = np.concatenate([_vectors(ends["a"]), _vectors(ends["b"])])
    np.testing.assert_allclose(got, alone, atol=1e-5)
    assert ends["a"].prompt_tokens == sum(map(len, ids[:4]))


def test_one_input_longer_than_the_budget_still_runs(encoder):
    model, tok = encoder
    ids = tok.encode("a rather long text " * 4)
    engine = EncoderEngine(model, tok, batch_size=8, max_num_batched_tokens=4)
    engine.add(_payload("long", [ids]))
    outs = engine.step()
    assert outs[0].end.finish_reason is FinishReason.STOP and len(outs[0].end.pooled) == 1


def test_a_cancel_between_steps_runs_none_of_the_rest(encoder):
    model, tok = encoder
    ids = [tok.encode(f"input {i}") for i in range(6)]
    engine = EncoderEngine(model, tok, batch_size=8, max_num_batched_tokens=len(ids[0]))
    engine.add(_payload("c", ids))
    assert engine.step() == [] and engine.last_step_size == 1
    engine.cancel("c")
    outs = engine.step()
    assert [o.end.finish_reason for o in outs] == [FinishReason.CANCELLED] and outs[0].end.pooled is None
    assert not engine.has_work()


def test_a_generation_and_a_task_the_model_lacks_end_with_an_error(encoder):
    model, tok = encoder
    engine = EncoderEngine(model, tok, batch_size=8, max_num_batched_tokens=64)
    engine.add(RequestPayload(id="gen", model="m", prompt_token_ids=[101, 102], params=SamplingParams(max_tokens=4)))
    engine.add(_payload("cls", [[101, 102]], task="classify"))
    engine.add(_payload("yesno", [[101, 102]], task="score"))
    engine.add(_payload("prompt", [[101, 102]], task="logprobs"))
    ends = {o.request_id: o.end for o in engine.step()}
    assert {rid: end.finish_reason for rid, end in ends.items()} == dict.fromkeys(["gen", "cls", "yesno", "prompt"],
                                                                                   FinishReason.ERROR)
    assert "generates no text" in ends["gen"].error and "no classification head" in ends["cls"].error
