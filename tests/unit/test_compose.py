"""docker-compose.yml and its nginx stay true to the code (no Docker engine runs here, so check what we can).

The nginx config is checked by Debian's nginx itself (`nginx -t`; `make test` installs it). Prometheus's and
Grafana's files are checked by tests/unit/test_monitoring.py; here, that compose wires them to the services.
"""
import re
import shlex
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from api.core.auth import auth_enabled
from streamq import serve as serve_module
from streamq.cli import main as cli_main
from shared.nginx import compose_config, serve_config
from streamq.serve import find_nginx
from shared.settings import ApiSettings, SchedulerSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
SETTINGS = {"api": ApiSettings, "worker": WorkerSettings, "scheduler": SchedulerSettings}
TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def nginx() -> str:
    binary = find_nginx()
    if binary is None:
        pytest.fail("nginx is not installed: run scripts/ensure-nginx.sh (make test does)")
    return binary


def _directive(text: str, name: str) -> str:
    """The value of the one `name ...;` line of an nginx config."""
    values = re.findall(rf"^\s*{re.escape(name)}\s+(.+?);", text, flags=re.MULTILINE)
    assert len(values) == 1, (name, values)
    return values[0]


def _nginx_test(nginx: str, config: Path, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([nginx, "-t", "-c", str(config), "-g", f"pid {folder / 'nginx.pid'};"],
                          capture_output=True, text=True)


def test_every_streamq_command_exists(compose, capsys):
    for name, service in compose["services"].items():
        command = service.get("command")
        if not command or command[0] != "streamq":
            continue
        with pytest.raises(SystemExit) as info:
            cli_main([*command[1:], "--help"])
        assert info.value.code == 0, name


def test_environment_names_real_settings(compose):
    for name, cls in SETTINGS.items():
        env = compose["services"][name]["environment"]
        for var in env:
            if var == "REDIS_URL":
                continue
            assert var.startswith("STREAMQ_"), var
            assert var.removeprefix("STREAMQ_").lower() in cls.model_fields, f"{name}: {var}"


def test_of_streamq_only_the_load_balancer_publishes_a_port_and_it_reaches_the_api_port(compose):
    api, lb = compose["services"]["api"], compose["services"]["lb"]
    assert "ports" not in api  # replicas share nothing on the host; the lb is the way in
    assert not [name for name, s in compose["services"].items() if s.get("image") == "streamq:latest" and "ports" in s]
    assert lb["ports"] == [f"8000:{_directive(NGINX_CONF.read_text(), 'listen')}"]
    host, port = _directive(NGINX_CONF.read_text(), "set $api_upstream").split(":")
    assert host == "api" and host in compose["services"]
    assert port == api["environment"]["STREAMQ_PORT"]
    assert ApiSettings(port=int(port)).port == int(port)


def test_the_api_answers_its_health_check_and_the_hosts_nginx_and_prometheus_name(compose):
    """Each names the api by its own Host (127.0.0.1, the client's through nginx, the container's address)."""
    from fastapi.testclient import TestClient

    from api.app import create_app

    api = compose["services"]["api"]
    env = {k.removeprefix("STREAMQ_").lower(): v for k, v in api["environment"].items() if k.startswith("STREAMQ_")}
    app = create_app(ApiSettings(_env_file=None, **env))
    [check] = re.findall(r"urlopen\('(http://[^/']+)(/[^']*)'\)", " ".join(api["healthcheck"]["test"]))
    assert TestClient(app, base_url=check[0]).get(check[1]).status_code == 200
    for host in ("localhost:8000", "streamq.example.com", "172.18.0.5:8000"):
        assert TestClient(app, base_url=f"http://{host}").get("/healthz").status_code == 200, host


def test_api_runs_several_replicas(compose):
    assert compose["services"]["api"]["deploy"]["replicas"] >= 2


def test_load_balancer_mounts_the_nginx_config(compose):
    lb = compose["services"]["lb"]
    assert lb["image"].startswith("nginx:")
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in lb["volumes"]
    assert lb["depends_on"]["api"]["condition"] == "service_healthy"


def test_nginx_passes_streams_through_as_the_api_needs():
    text = NGINX_CONF.read_text()
    assert _directive(text, "proxy_buffering") == "off" and _directive(text, "proxy_cache") == "off"
    assert _directive(text, "proxy_http_version") == "1.1"
    assert _directive(text, "proxy_set_header Connection") == '""'
    assert _directive(text, "proxy_set_header Last-Event-ID") == "$http_last_event_id"
    assert _directive(text, "proxy_set_header Authorization") == "$http_authorization"
    # Longer than the longest long-poll a replica may be configured for, and than any SSE ping interval.
    read_timeout = int(_directive(text, "proxy_read_timeout").removesuffix("s"))
    longest_wait = next(m.le for m in ApiSettings.model_fields["max_wait_s"].metadata if hasattr(m, "le"))
    assert read_timeout >= longest_wait
    # The same body limit as the api (nginx answers 413 before a replica sees the body).
    limit = ApiSettings.model_fields["max_body_bytes"].default
    assert _directive(text, "client_max_body_size") == str(limit)
    assert f"limit of {limit} bytes" in text


def test_nginx_accepts_the_compose_config(nginx, tmp_path):
    """`nginx -t` on deploy/nginx.conf as compose mounts it, but for where the files go.

    `api` is looked up only while serving (resolver + variable), so `nginx -t` needs no Docker
    DNS; only the temp folders move from nginx's built-in ones (root-only) to tmp_path.
    """
    paths = "".join(f"    {kind}_temp_path {tmp_path / kind};\n" for kind in TEMP_PATHS)
    config = tmp_path / "nginx.conf"
    config.write_text(NGINX_CONF.read_text().replace("http {\n", "http {\n" + paths, 1))
    result = _nginx_test(nginx, config, tmp_path)
    assert result.returncode == 0, result.stderr
    # And nginx -t does read it: a wrong directive is refused.
    config.write_text(config.read_text().replace("proxy_buffering off;", "proxy_buffering nope;"))
    assert _nginx_test(nginx, config, tmp_path).returncode != 0


def test_compose_config_is_the_template_rendered():
    assert NGINX_CONF.read_text() == compose_config(), (
        "deploy/nginx.conf differs from shared/nginx.conf.j2: edit the template, then "
        "`python -m shared.nginx > deploy/nginx.conf`")


def test_the_nginx_template_ships_with_the_package():
    # serve renders it from an installed package too (tomllib is not in Python 3.10: read the line)
    package_data = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert re.search(r'^shared = \[[^]]*"nginx\.conf\.j2"', package_data, flags=re.MULTILINE)


def _blocks(text: str) -> list[str]:
    """The config's directives and block openings in order, without comments or indentation."""
    lines = (re.sub(r"#.*", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line]


def _proxying(text: str) -> list[str]:
    """The server block, but for where it listens and the replicas' address."""
    blocks = _blocks(text)
    return [b for b in blocks[blocks.index("server {"):] if not b.startswith(("listen ", "set $api_upstream "))]


def test_nginx_accepts_the_config_that_serve_renders(nginx, tmp_path):
    text = serve_config("127.0.0.1", 18000, [18001, 18002], tmp_path)
    # The replicas are a fixed upstream (keep-alive) instead of compose's DNS lookup.
    blocks = _blocks(text)
    start = blocks.index("upstream streamq_api {")
    assert blocks[start:start + 5] == ["upstream streamq_api {", "server 127.0.0.1:18001;", "server 127.0.0.1:18002;",
                                       "keepalive 16;", "}"]
    assert _directive(text, "set $api_upstream") == "streamq_api" and "proxy_pass http://$api_upstream;" in blocks
    assert _directive(text, "listen") == "127.0.0.1:18000" and not re.search(r"^\s*resolver ", text, flags=re.MULTILINE)
    # Runs as an ordinary user: in the foreground, its files in its own folder.
    assert _directive(text, "daemon") == "off" and _directive(text, "worker_processes") == "1"
    assert _directive(text, "pid") == f"{tmp_path}/nginx.pid"
    for kind in TEMP_PATHS:
        assert _directive(text, f"{kind}_temp_path") == str(tmp_path / kind)
    # Everything about streams is the same as compose's: SSE unbuffered, timeouts, headers, body limit.
    assert _directive(text, "proxy_buffering") == "off" and _directive(text, "proxy_cache") == "off"
    assert _proxying(text) == _proxying(compose_config())
    config = tmp_path / "nginx.conf"
    config.write_text(text)
    result = subprocess.run([nginx, "-t", "-c", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_redis_keeps_an_append_only_file_on_a_volume(compose):
    redis = compose["services"]["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_worker_reserves_a_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_worker_metrics_listen_on_the_network_at_the_exposed_port(compose):
    worker = compose["services"]["worker"]
    settings = WorkerSettings(**{k.removeprefix("STREAMQ_").lower(): v for k, v in worker["environment"].items()
                                 if k.startswith("STREAMQ_METRICS")})
    assert settings.metrics_host == "0.0.0.0" and [str(settings.metrics_port)] == [str(p) for p in worker["expose"]]


def test_dockerfile_copies_every_package():
    text = (ROOT / "Dockerfile").read_text()
    for package in ("api", "worker", "scheduler", "shared"):
        assert f"COPY {package} " in text


def test_nginx_listens_on_every_address_for_a_wildcard_host(nginx, tmp_path):
    text = serve_config("::", 18000, [18001, 18002], tmp_path)
    assert "listen [::]:18000 ipv6only=off;" in text
    config = tmp_path / "nginx.conf"
    config.write_text(text)
    result = subprocess.run([nginx, "-t", "-c", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_serve_with_replicas_but_no_nginx_says_how_to_install_it(monkeypatch, caplog):
    monkeypatch.setattr(serve_module, "find_nginx", lambda: None)
    assert serve_module.serve("127.0.0.1", 18000, api_replicas=2) == 1  # before starting anything
    assert "nginx is not installed" in caplog.text and "apt-get install nginx" in caplog.text


def test_dockerfile_copies_every_requirements_file_it_installs():
    text = (ROOT / "Dockerfile").read_text()
    copied = {name for line in text.splitlines() if line.startswith("COPY ") for name in line.split()[1:-1]}
    installed = set(re.findall(r"-r (\S+)", text))
    assert installed and installed <= copied
    assert all((ROOT / name).is_file() for name in installed)


# -- Prometheus and Grafana -----------------------------------------------------------------------------------

PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"


def _mounts(service: dict) -> dict[str, str]:
    """A service's mounts: container path -> source (a ./ path or a volume name)."""
    return {target: source for source, target, *_ in (v.split(":") for v in service["volumes"])}


def _flag(service: dict, name: str) -> str:
    [value] = [arg.split("=", 1)[1] for arg in service["command"] if arg.startswith(f"--{name}=")]
    return value


def _local(source: str) -> Path:
    return ROOT / source.removeprefix("./")


def test_prometheus_reads_its_config_and_rules_from_deploy(compose):
    prometheus = compose["services"]["prometheus"]
    mounts = _mounts(prometheus)
    config_file = PurePosixPath(_flag(prometheus, "config.file"))
    folder = _local(mounts[str(config_file.parent)])
    assert folder == PROMETHEUS_DIR and (folder / config_file.name).is_file()
    config = yaml.safe_load((folder / config_file.name).read_text())
    assert all((folder / rules).is_file() for rules in config["rule_files"])  # relative to the config file
    assert mounts[_flag(prometheus, "storage.tsdb.path")] in compose["volumes"]  # its data outlives the container


def test_prometheus_scrapes_every_api_replica_and_worker_by_their_compose_names(compose):
    services = compose["services"]
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    ports = {"api": int(services["api"]["environment"]["STREAMQ_PORT"]),
             "worker": int(services["worker"]["environment"]["STREAMQ_METRICS_PORT"])}
    assert [int(p) for p in services["worker"]["expose"]] == [ports["worker"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"streamq-api", "streamq-worker"}
    for name, job in jobs.items():
        # Compose's DNS answers a service's name with each of its containers: one target per replica.
        [discovery] = job["dns_sd_configs"]
        [service] = discovery["names"]
        assert name == f"streamq-{service}" and discovery["type"] == "A" and discovery["port"] == ports[service]
        assert job["metrics_path"] == "/metrics"


def test_the_key_prometheus_scrapes_the_api_with_is_made_where_it_reads_it(compose):
    """The replicas bind 0.0.0.0, so their /metrics needs a key: a one-off service makes it into a volume."""
    services = compose["services"]
    api = services["api"]["environment"]
    assert "STREAMQ_AUTH" not in api and auth_enabled("auto", api["STREAMQ_HOST"])
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    [key_file] = [PurePosixPath(j["authorization"]["credentials_file"]) for j in config["scrape_configs"]
                  if "authorization" in j]
    prometheus, maker = services["prometheus"], services["prometheus-key"]
    volume = _mounts(prometheus)[str(key_file.parent)]
    assert volume in compose["volumes"] and f"{volume}:{key_file.parent}:ro" in prometheus["volumes"]
    [written_in] = [target for target, source in _mounts(maker).items() if source == volume]
    assert prometheus["depends_on"]["prometheus-key"]["condition"] == "service_completed_successfully"
    assert maker["restart"] == "no" and maker["depends_on"]["redis"]["condition"] == "service_healthy"
    shell = maker["command"][2]
    assert f"> {written_in}/{key_file.name}.new && mv {written_in}/{key_file.name}.new {written_in}/{key_file.name}" \
        in shell and shell.startswith(f"test -s {written_in}/{key_file.name} ||")  # made once, never half-written
    [create] = re.findall(r"streamq (keys create [^>]+)>", shell)
    with pytest.raises(SystemExit) as info:
        cli_main([*shlex.split(create), "--help"])
    assert info.value.code == 0


def test_grafana_is_provisioned_from_deploy_grafana(compose):
    grafana, prometheus = compose["services"]["grafana"], compose["services"]["prometheus"]
    mounts = _mounts(grafana)
    assert _local(mounts["/etc/grafana/provisioning"]) == GRAFANA_DIR / "provisioning"
    [provider] = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "streamq.yml").read_text())["providers"]
    assert provider["type"] == "file"
    assert _local(mounts[provider["options"]["path"]]) == GRAFANA_DIR / "dashboards"
    assert (GRAFANA_DIR / "dashboards" / "streamq.json").is_file()
    [source] = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == "http://prometheus:9090"  # the service's name, and Prometheus's own port
    assert [p.rsplit(":", 1)[1] for p in prometheus["ports"]] == ["9090"]
    assert mounts["/var/lib/grafana"] in compose["volumes"]


def test_prometheus_and_grafana_are_published_on_this_host_only(compose):
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in compose["services"][name]["ports"]), name
