"""docker-compose.yml stays true to the code (no Docker engine runs here, so check what we can)."""
from pathlib import Path

import pytest
import yaml

from shared.cli import main as cli_main
from shared.settings import ApiSettings, SchedulerSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"api": ApiSettings, "worker": WorkerSettings, "scheduler": SchedulerSettings}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


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


def test_api_port_matches_its_setting(compose):
    api = compose["services"]["api"]
    assert api["ports"] == [f"8000:{api['environment']['STREAMQ_PORT']}"]
    assert ApiSettings(port=int(api["environment"]["STREAMQ_PORT"])).port == 8000


def test_redis_keeps_an_append_only_file_on_a_volume(compose):
    redis = compose["services"]["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert any(v.endswith(":/data") for v in redis["volumes"])


def test_worker_reserves_a_gpu(compose):
    devices = compose["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]


def test_dockerfile_copies_every_package():
    text = (ROOT / "Dockerfile").read_text()
    for package in ("api", "worker", "scheduler", "shared"):
        assert f"COPY {package} " in text
