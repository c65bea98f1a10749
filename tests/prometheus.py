"""A real Prometheus for the tests (Debian's, from scripts/ensure-prometheus.sh): a child process on a free
port with its own config and data folder, asked through its HTTP API; and the PromQL of the shipped dashboard
and alerts (deploy/grafana, deploy/prometheus)."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from shared.children import terminate
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "streamq.json"
ALERTS = PROMETHEUS_DIR / "alerts.yml"


def tool(name: str) -> str:
    """The path of `prometheus` or `promtool`; the test fails saying how to install it when missing."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/ensure-prometheus.sh (`make test` does)", pytrace=False)
    return found


def dashboard_queries(rate_interval: str) -> dict[str, str]:
    """Every PromQL expression of the dashboard, by "<panel title>: <legend>", with Grafana's
    `$__rate_interval` given (the only Grafana variable the dashboard uses)."""
    queries = {}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            queries[f"{panel['title']}: {target['legendFormat']}"] = target["expr"].replace(
                "$__rate_interval", rate_interval)
    return queries


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


class Prometheus:
    """`prometheus` on 127.0.0.1 with `config` (a dict, written as its prometheus.yml) and its data in `folder`."""

    def __init__(self, folder: Path, config: dict):
        self.folder, self.config = folder, config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        log = open(self.folder / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={self.folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"prometheus did not start:\n{self.log()}")
            time.sleep(0.1)  # readiness polling only
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def api(self, path: str, **params) -> dict | list:
        """The `data` of a /api/v1 answer (an error answer fails the test with Prometheus's message)."""
        reply = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` evaluates to now (/api/v1/query)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def log(self) -> str:
        return (self.folder / "prometheus.log").read_text(errors="replace")[-4000:]

    def __exit__(self, *exc) -> None:
        terminate(self.process, 10)
