"""deploy/prometheus and deploy/grafana stay valid and true to the code.

The alert rules pass `promtool check rules` and their unit tests (`promtool test rules
alerts_test.yml`); both Prometheus configs pass `promtool check config`; the dashboard and the
rules read only metrics the api or the worker exports, each by its type's names. Whether each
query gives data on a live stack is tests/e2e/test_dashboard.py's part.
"""
from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from api.core.metrics import ApiMetrics
from tests.prometheus import ALERTS, DASHBOARD, GRAFANA_DIR, PROMETHEUS_DIR, alert_rules, dashboard_queries, tool
from worker.service.metrics import WorkerMetrics

# The four alerts and its panels (title: what it shows).
ALERT_NAMES = {"StreamqNoReadyWorker", "StreamqQueueGrowing", "StreamqTimeToFirstTokenHigh", "StreamqDeadLetters"}
PANELS = {"Tokens/s", "Time to first token", "Inter-token latency", "Queue depth", "Queue time", "Running and waiting",
          "KV-cache usage", "Preemptions", "Prefix-cache hit rate", "Speculative acceptance", "API status codes",
          "Per-tenant throughput"}
DATASOURCE = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
# The suffixes a scrape gives each type's samples.
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}


@pytest.fixture(scope="module")
def promtool() -> str:
    return tool("promtool")


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, **kwargs)


def test_the_alert_rules_pass_promtool_check(promtool):
    result = _run(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in result.stdout


def test_the_alert_rules_pass_their_unit_tests(promtool):
    result = _run(promtool, "test", "rules", "alerts_test.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules_fails_on_a_wrong_expectation(promtool, tmp_path):
    """The unit tests do compare: an expected alert that the rules do not give fails."""
    for name in ("alerts.yml", "alerts_test.yml"):
        (tmp_path / name).write_text((PROMETHEUS_DIR / name).read_text())
    tests = tmp_path / "alerts_test.yml"
    tests.write_text(tests.read_text().replace("- eval_time: 2m30s", "- eval_time: 1m", 1))
    assert _run(promtool, "test", "rules", "alerts_test.yml", cwd=tmp_path).returncode != 0


def test_every_alert_is_there_and_shown_firing_in_its_unit_tests():
    rules = alert_rules()
    assert {r["alert"] for r in rules} == ALERT_NAMES
    assert all(r["labels"]["severity"] in ("critical", "warning") and r["annotations"]["summary"] for r in rules)
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())
    assert tests["rule_files"] == [ALERTS.name]
    fired = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == quiet == ALERT_NAMES


def _checkable(config: dict, folder) -> dict:
    """A config promtool can check here: the key file in `folder` (promtool opens it), and no Kubernetes
    discovery (Debian builds Prometheus without it; the Kubernetes side is tests/unit/test_k8s.py's)."""
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(folder / "api-key")
        if "kubernetes_sd_configs" in job:
            del job["kubernetes_sd_configs"]
            job["static_configs"] = [{"targets": []}]
    return config


@pytest.mark.parametrize("name", ["prometheus.yml", "kubernetes.yml"])
def test_the_prometheus_configs_pass_promtool_check(promtool, tmp_path, name):
    config = yaml.safe_load((PROMETHEUS_DIR / name).read_text())
    (tmp_path / "api-key").write_text("sk-test")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(_checkable(config, tmp_path)))
    (tmp_path / "alerts.yml").write_text(ALERTS.read_text())
    result = _run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_and_kubernetes_scrape_the_same_jobs_alike():
    compose, k8s = (yaml.safe_load((PROMETHEUS_DIR / n).read_text()) for n in ("prometheus.yml", "kubernetes.yml"))
    assert compose["global"] == k8s["global"] and compose["rule_files"] == k8s["rule_files"] == [ALERTS.name]
    for one, other in zip(compose["scrape_configs"], k8s["scrape_configs"], strict=True):
        assert one["job_name"] == other["job_name"] and one["metrics_path"] == other["metrics_path"] == "/metrics"
        assert one.get("authorization") == other.get("authorization")
    # Only the api's /metrics needs a key (the worker's port serves no tenant's data).
    assert [j["job_name"] for j in compose["scrape_configs"] if "authorization" in j] == ["streamq-api"]
    # Grafana's $__rate_interval is computed from the scrape interval it is told.
    [source] = yaml.safe_load(DATASOURCE.read_text())["datasources"]
    assert source["jsonData"]["timeInterval"] == compose["global"]["scrape_interval"]


def _exported() -> dict[str, str]:
    """Every sample name the api and the worker expose -> its metric's type."""
    return {family.name + suffix: family.type
            for registry in (ApiMetrics().registry, WorkerMetrics().registry)
            for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


def test_the_dashboard_and_the_rules_read_only_exported_metrics():
    exported = _exported()
    exprs = [*dashboard_queries("1m").values(), *(r["expr"] for r in alert_rules())]
    for expr in exprs:
        for name in re.findall(r"streamq:[a-z_:]+", expr):
            assert name in exported, (name, expr)
            if "rate(" + name in expr or "increase(" + name in expr:  # a rate is of a counter or a histogram
                assert exported[name] in ("counter", "histogram"), (name, expr)
            if "delta(" + name in expr or "deriv(" + name in expr:  # and a delta of a gauge
                assert exported[name] == "gauge", (name, expr)
    # Every panel the issue names is there, and the fleet numbers the alerts watch are shown too.
    read = {name for expr in exprs for name in re.findall(r"streamq:[a-z_:]+", expr)}
    assert {"streamq:num_workers_ready", "streamq:dead_letter_requests", "streamq:tenant_generation_tokens_total"} <= read


def test_the_dashboard_is_a_provisionable_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    [source] = yaml.safe_load(DATASOURCE.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["uid"]
    assert dashboard["uid"] and dashboard["title"] and "id" not in dashboard  # Grafana gives the id
    # Its panels read the datasource variable: the provisioned Prometheus here, any Prometheus in another
    # Grafana (kube-prometheus-stack's, which loads the same file from the labelled ConfigMap).
    [variable] = dashboard["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    assert variable["current"]["value"] == source["uid"] and variable["current"]["text"] == source["name"]
    panels = dashboard["panels"]
    assert PANELS <= {p["title"] for p in panels}
    assert len({p["id"] for p in panels}) == len(panels)
    taken = set()
    for panel in panels:
        assert panel["type"] in ("timeseries", "stat") and panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": f"${{{variable['name']}}}"}, panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]  # Grafana's grid is 24 wide
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
    # Grafana's variables: only $__rate_interval, which the tests replace as Grafana would.
    assert {v for e in dashboard_queries("$__rate_interval").values() for v in re.findall(r"\$\w+", e)} \
        == {"$__rate_interval"}
