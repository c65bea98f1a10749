"""The worker's own /metrics (its port is in its heartbeat): counts match what was sent."""
from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import submit, wait_done

PROMPTS = ["one", "two words", "and three words"]
MAX_TOKENS = [3, 5, 7]


def scrape(client: httpx.Client, url: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(client.get(url).text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_worker_metrics_count_what_was_sent(stack):
    with httpx.Client(timeout=60) as client:
        [worker] = client.get(f"{stack.urls[0]}/readyz").json()["workers"]
        assert worker["kv_blocks_total"] > 0 and 0 <= worker["kv_blocks_free"] <= worker["kv_blocks_total"]
        metrics = f"http://127.0.0.1:{worker['metrics_port']}/metrics"
        before = scrape(client, metrics)
        ids = [submit(client, stack.urls[0], prompt=p, max_tokens=n, ignore_eos=True)["id"]
               for p, n in zip(PROMPTS, MAX_TOKENS)]
        states = [wait_done(client, stack.urls[0], rid) for rid in ids]
        after = scrape(client, metrics)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    n = len(PROMPTS)
    assert delta("streamq:generation_tokens_total") == sum(MAX_TOKENS)
    assert delta("streamq:tenant_generation_tokens_total", tenant="-") == sum(MAX_TOKENS)  # auth off: no tenant
    assert delta("streamq:prompt_tokens_total") == sum(s["prompt_tokens"] for s in states)
    assert delta("streamq:request_success_total", finished_reason="length") == n
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"streamq:{histogram}_count") == n, histogram
    assert delta("streamq:inter_token_latency_seconds_count") == sum(MAX_TOKENS) - n
    assert delta("streamq:step_duration_seconds_count") >= max(MAX_TOKENS)
    assert after[("streamq:num_requests_running", ())] == 0
    used, free = after[("streamq:kv_cache_blocks_used", ())], after[("streamq:kv_cache_blocks_free", ())]
    assert used + free == worker["kv_blocks_total"]
    assert delta("streamq:prefix_cache_queries_total") >= delta("streamq:prefix_cache_hits_total") >= 0
    assert ("streamq:num_preemptions_total", ()) in after
    # Where the steps' time went: every phase counted, the forward and the publish took some.
    phases = {phase: delta("streamq:step_phase_seconds_total", phase=phase)
              for phase in ("arrivals", "schedule", "forward", "sample", "publish")}
    assert all(seconds >= 0 for seconds in phases.values()) and phases["forward"] > 0 and phases["publish"] > 0


def test_each_replica_shows_the_models_backlog(stack):
    """The gauge the workers' autoscaler reads (deploy/k8s/keda): nothing waits once all is done."""
    with httpx.Client(timeout=60) as client:
        [worker] = client.get(f"{stack.urls[0]}/readyz").json()["workers"]
        for url in stack.urls:
            queued = scrape(client, f"{url}/metrics")
            assert queued[("streamq:num_requests_queued", (("model", worker["model"]),))] == 0, url


def test_the_worker_says_its_execution_plan_in_readyz_and_its_metrics(stack):
    with httpx.Client(timeout=60) as client:
        [worker] = client.get(f"{stack.urls[0]}/readyz").json()["workers"]
        plan = worker["plan"]
        samples = scrape(client, f"http://127.0.0.1:{worker['metrics_port']}/metrics")
    assert plan["engine"] == "paged" and plan["dtype"] == "float32" and plan["device"] == "cpu"
    assert plan["forward"] in ("llama-kernels", "llama-fused")  # the kernels where they build here
    assert samples[("streamq:worker_plan_info", tuple(sorted(plan.items())))] == 1.0


def test_the_worker_says_the_bytes_of_its_weights(stack, tiny_llama):
    """model_weight_bytes: what a step reads, as held. The tiny model's fp32 weights: each counted
    (no fewer bytes than its file's), the tied head twice (its table for the embedding, its panels
    for the kernels), nothing else twice."""
    files = sum(f.stat().st_size for f in Path(tiny_llama).glob("*.safetensors"))
    with httpx.Client(timeout=60) as client:
        [worker] = client.get(f"{stack.urls[0]}/readyz").json()["workers"]
        samples = scrape(client, f"http://127.0.0.1:{worker['metrics_port']}/metrics")
    weights = samples[("streamq:model_weight_bytes", ())]
    assert files <= weights < 2 * files
