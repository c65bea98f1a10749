"""The Grafana dashboard and the alerts against a real Prometheus scraping a running stack.

Prometheus (Debian's) scrapes the api replicas and the worker with the shipped scrape config
(deploy/prometheus/prometheus.yml: its jobs, paths and key file, with the processes' real ports
in place of compose's DNS names, and a 1 s interval) while two tenants stream requests. Every
PromQL expression of deploy/grafana/dashboards/streamq.json must then give a number. Last, the
worker is killed and the no-ready-worker alert of deploy/prometheus/alerts.yml must fire.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time

import httpx
import pytest
import yaml
from redis.asyncio import Redis

from shared.api_keys import KeyStore
from tests.prometheus import ALERTS, PROMETHEUS_DIR, Prometheus, alert_rules, dashboard_queries
from tests.stack import Stack, stream_events

SCRAPE_S = 1
# Grafana's $__rate_interval is at least four scrape intervals; a little more keeps a window's
# histogram from being empty between two requests' first tokens on a busy machine.
RATE_INTERVAL = "10s"
TENANTS = ("acme", "globex")
# Repeated text (86 tokens of the tiny model's 256): later requests find its blocks in the prefix cache,
# and prompt lookup finds its drafts.
PROMPT = "a b c d e f g h i j k l m n o p " * 3
ENV = {"STREAMQ_AUTH": "on", "STREAMQ_SPECULATIVE_METHOD": "ngram", "STREAMQ_NGRAM_MIN": "1",
       "STREAMQ_NUM_SPECULATIVE_TOKENS": "4",
       # A killed worker's heartbeat is gone within 3 s, not the default 6.
       "STREAMQ_HEARTBEAT_INTERVAL_S": "0.5", "STREAMQ_HEARTBEAT_TTL_S": "3"}
NO_WORKER = "StreamqNoReadyWorker"


def _keys(stack: Stack) -> dict[str, str]:
    async def create() -> dict[str, str]:
        redis = Redis.from_url(stack.env["REDIS_URL"], decode_responses=True)
        try:
            store = KeyStore(redis, stack.prefix)
            return {tenant: await store.create(tenant, "e2e") for tenant in (*TENANTS, "monitoring", "admin")}
        finally:
            await redis.aclose()
    return asyncio.run(create())


def _config(stack: Stack, worker_port: int, key_file, rules_file) -> dict:
    """The shipped prometheus.yml, with these processes as its targets, 1 s intervals and the test's rules."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"}
    config["rule_files"] = [str(rules_file)]
    targets = {"streamq-api": [url.removeprefix("http://") for url in stack.urls],
               "streamq-worker": [f"127.0.0.1:{worker_port}"]}
    for job in config["scrape_configs"]:
        del job["dns_sd_configs"]
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(key_file)
    return config


def _rules(folder) -> str:
    """alerts.yml as shipped but for the no-ready-worker alert's `for`: 2 s instead of a minute, so the
    test need not wait one (it still has to hold over two evaluations)."""
    groups = yaml.safe_load(ALERTS.read_text())
    [rule] = [r for g in groups["groups"] for r in g["rules"] if r.get("alert") == NO_WORKER]
    rule["for"] = f"{2 * SCRAPE_S}s"
    path = folder / "alerts.yml"
    path.write_text(yaml.safe_dump(groups))
    return path


class Load:
    """Each tenant streams requests, one after another, until stopped."""

    def __init__(self, url: str, keys: dict[str, str]):
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(url, keys[t]), daemon=True) for t in TENANTS]

    def _run(self, url: str, key: str) -> None:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
                while not self.stop.is_set():
                    events = stream_events(client, "POST", f"{url}/v1/requests", json=body)
                    assert events[-1]["event"] == "final", events[-1]
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.errors.append(exc)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def running(self) -> None:
        """Fail at once where a tenant's request failed (rather than wait for data that cannot come)."""
        assert not self.errors, self.errors

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        self.running()


def _poll(check, timeout_s: float, what: str, load: Load | None = None):
    """Ask Prometheus again until `check()` answers (done, answer) with done true (Prometheus's own
    scrapes and evaluations bring it about); the answer, or a failure after timeout_s with the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        if load is not None:
            load.running()
        done, answer = check()
        if done:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s; last answer: {answer}")
        time.sleep(SCRAPE_S / 4)


@pytest.mark.timeout(240)
def test_every_dashboard_query_gives_data_and_a_dead_worker_fires_its_alert(redis_url, tiny_llama, tmp_path):
    with Stack(redis_url, tiny_llama, tmp_path / "stack", replicas=2, env=ENV) as stack, \
            httpx.Client(timeout=30) as client:
        keys = _keys(stack)
        [worker] = client.get(f"{stack.urls[0]}/readyz", headers={"Authorization": f"Bearer {keys['admin']}"}
                              ).json()["workers"]  # the workers' details are the operator's
        key_file = tmp_path / "api-key"
        key_file.write_text(keys["monitoring"])
        config = _config(stack, worker["metrics_port"], key_file, _rules(tmp_path))
        with Prometheus(tmp_path / "prometheus", config) as prometheus:
            with Load(stack.urls[0], keys) as load:
                # Every target answers, with the key where one is needed.
                targets = _poll(lambda: _all_up(prometheus), 30, "three targets up", load)
                assert {t["labels"]["job"] for t in targets} == {"streamq-api", "streamq-worker"}
                queries, answers = dashboard_queries(RATE_INTERVAL), {}
                _poll(lambda: _answer(prometheus, queries, answers), 60, "number from every dashboard query", load)
                # The rules evaluate without error, and nothing fires while the worker serves.
                rules = prometheus.api("rules")["groups"][0]["rules"]
                assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
                assert all(r["health"] == "ok" for r in rules), rules
                assert _firing(prometheus, NO_WORKER) == []
                # Each tenant's tokens are counted apart.
                _poll(lambda: _tenants(prometheus), 30, "series for each tenant", load)
            stack.kill_worker(stack.worker_name(0))
            [alert] = _poll(lambda: _fired(prometheus, NO_WORKER), 30, f"{NO_WORKER} firing")
            assert alert["labels"]["model"] == stack.model_name and alert["labels"]["severity"] == "critical"


def _all_up(prometheus: Prometheus) -> tuple[bool, list[dict]]:
    targets = prometheus.api("targets")["activeTargets"]
    return len(targets) == 3 and all(t["health"] == "up" for t in targets), targets


def _answer(prometheus: Prometheus, queries: dict[str, str], answers: dict[str, list]) -> tuple[bool, dict]:
    """Ask each query that has not yet given a number (a sample, not NaN: a ratio of two rates that
    saw nothing is NaN) and keep its answer once it has; done when all have. The answer: the others'."""
    waiting = {}
    for name, expr in queries.items():
        if name not in answers:
            result = prometheus.query(expr)
            if any(math.isfinite(float(sample["value"][1])) for sample in result):
                answers[name] = result
            else:
                waiting[name] = result
    return not waiting, waiting


def _tenants(prometheus: Prometheus) -> tuple[bool, set[str]]:
    tenants = {s["metric"]["tenant"] for s in prometheus.query("streamq:tenant_generation_tokens_total")}
    return tenants == set(TENANTS), tenants


def _firing(prometheus: Prometheus, name: str) -> list[dict]:
    return [a for a in prometheus.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"]


def _fired(prometheus: Prometheus, name: str) -> tuple[bool, list[dict]]:
    firing = _firing(prometheus, name)
    return bool(firing), firing
