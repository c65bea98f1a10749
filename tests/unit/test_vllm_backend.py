"""The vLLM backend's translation of streamq's settings and sampling parameters (no vLLM needed),
and the lanes that route a request to one backend."""
import pytest

from shared.messages import RequestPayload
from shared.queue import lane_of, served_by
from shared.sampling import BanTokens, SamplingParams
from shared.settings import WorkerSettings
from shared.structured import JSON_LAYOUT
from worker.backends.vllm_backend import BAN, engine_kwargs, sampling_kwargs


def test_every_sampling_parameter_is_mapped():
    params = SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, seed=7,
                            presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                            stop=["\n\n"], stop_token_ids=[5], ignore_eos=True, logit_bias={9: 3.5}, logprobs=4,
                            logits_processors=[BanTokens(token_ids=[11, 12])])
    kwargs = sampling_kwargs(params, max_tokens=30)
    assert kwargs == {"n": 1, "max_tokens": 30, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.05,
                      "seed": 7, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                      "stop_token_ids": [5], "ignore_eos": True, "logprobs": 4,
                      "logit_bias": {9: 3.5, 11: BAN, 12: BAN}, "detokenize": False, "structured_outputs": None}
    # Stop strings stay with streamq's detokenizer, as with the built-in engine.
    assert "stop" not in kwargs


@pytest.mark.parametrize("constraint, mapped", [
    ({"json": {"type": "integer"}}, {"json": {"type": "integer", "x-guidance": JSON_LAYOUT}}),
    ({"json_object": True}, {"json": {"type": "object", "x-guidance": JSON_LAYOUT}}),
    ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}), ({"choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'})])
def test_a_constraint_maps_to_vllms_structured_outputs(constraint, mapped):
    assert sampling_kwargs(SamplingParams(structured_outputs=constraint), 4)["structured_outputs"] == mapped


@pytest.mark.parametrize(("temperature", "sent"), [(0.0, 0.0), (1e-7, 0.0), (1.0, 1.0)])
def test_greedy_is_temperature_zero(temperature, sent):
    assert sampling_kwargs(SamplingParams(temperature=temperature), 4)["temperature"] == sent


def test_engine_settings_reach_vllm():
    settings = WorkerSettings(backend="vllm", batch_size=16, dtype="bfloat16", vllm_max_model_len=4096,
                              vllm_enforce_eager=True, vllm_gpu_memory_utilization=0.8, vllm_tensor_parallel_size=2,
                              vllm_quantization="fp8", prefix_caching=False,
                              vllm_speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    kwargs = engine_kwargs(settings, "/models/m")
    assert kwargs["model"] == "/models/m" and kwargs["max_num_seqs"] == 16 and kwargs["dtype"] == "bfloat16"
    assert (kwargs["max_model_len"], kwargs["enforce_eager"], kwargs["gpu_memory_utilization"]) == (4096, True, 0.8)
    assert (kwargs["tensor_parallel_size"], kwargs["quantization"]) == (2, "fp8")
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}


def test_a_request_for_one_backend_has_a_lane_only_that_backend_reads():
    payload = RequestPayload(id="r", model="m", prompt_token_ids=[1], params=SamplingParams(), tenant="acme")
    anyone = lane_of(payload)
    vllm_only = lane_of(payload.model_copy(update={"backend": "vllm"}))
    assert anyone == "0:acme" and vllm_only == "@vllm/0:acme"
    assert served_by(anyone, "hf") and served_by(anyone, "vllm")
    assert served_by(vllm_only, "vllm") and not served_by(vllm_only, "hf")


def test_choosing_vllm_without_it_installed_says_how(monkeypatch):
    import asyncio
    import sys

    from worker.backends.vllm_backend import VllmBackend, VllmUnavailable

    monkeypatch.setitem(sys.modules, "vllm", None)  # as in an environment without vLLM
    with pytest.raises(VllmUnavailable, match="make vllm-env"):
        asyncio.run(VllmBackend.start(WorkerSettings(backend="vllm"), "/models/m", tokenizer=None))
