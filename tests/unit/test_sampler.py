import torch

from shared.sampling import SamplingParams
from worker.sampler import make_generator, sample

LOGITS = torch.tensor([0.1, 2.0, 0.5, 1.9, -1.0])


def test_greedy_takes_the_argmax():
    params = SamplingParams(temperature=0)
    assert make_generator(params, torch.device("cpu")) is None
    assert sample(LOGITS, params, None) == 1


def test_top_k_one_is_greedy_whatever_the_temperature():
    params = SamplingParams(temperature=3.0, top_k=1, seed=1)
    gen = make_generator(params, torch.device("cpu"))
    assert {sample(LOGITS, params, gen) for _ in range(50)} == {1}


def test_small_top_p_keeps_only_the_most_likely_token():
    params = SamplingParams(temperature=1.0, top_p=0.05, seed=3)
    gen = make_generator(params, torch.device("cpu"))
    assert {sample(LOGITS, params, gen) for _ in range(50)} == {1}


def test_same_seed_same_samples():
    params = SamplingParams(temperature=1.0, seed=1234)
    draws = []
    for _ in range(2):
        gen = make_generator(params, torch.device("cpu"))
        draws.append([sample(LOGITS, params, gen) for _ in range(40)])
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1  # it does sample, not argmax


def test_top_k_excludes_the_rest():
    params = SamplingParams(temperature=2.0, top_k=2, seed=5)
    gen = make_generator(params, torch.device("cpu"))
    assert {sample(LOGITS, params, gen) for _ in range(200)} == {1, 3}
