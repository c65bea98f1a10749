import pytest
from pydantic import ValidationError

from shared.sampling import SamplingParams
from shared.settings import ApiSettings, CommonSettings, WorkerSettings


def test_redis_url_comes_from_REDIS_URL(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://example:1234/2")
    assert CommonSettings().redis_url == "redis://example:1234/2"


def test_streamq_prefixed_variables_set_fields(monkeypatch):
    monkeypatch.setenv("STREAMQ_BATCH_SIZE", "3")
    monkeypatch.setenv("STREAMQ_PREFIX", "blue")
    settings = WorkerSettings()
    assert settings.batch_size == 3 and settings.prefix == "blue"


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("batch_size", 5000), ("dtype", "int3"),
                                         ("heartbeat_interval_s", 0)])
def test_worker_settings_bounds(field, value):
    with pytest.raises(ValidationError) as info:
        WorkerSettings(**{field: value})
    assert field in str(info.value)


def test_heartbeat_check_names_both_values():
    with pytest.raises(ValidationError) as info:
        WorkerSettings(heartbeat_interval_s=6, heartbeat_ttl_s=10)
    message = str(info.value)
    assert "heartbeat_ttl_s=10" in message and "heartbeat_interval_s=6" in message


@pytest.mark.parametrize("values,names", [
    ({"speculative_method": "ngram", "ngram_min": 5, "ngram_max": 3}, ["ngram_min=5", "ngram_max=3"]),
    ({"speculative_method": "draft"}, ["speculative_model"]),
    ({"speculative_method": "ngram", "backend": "vllm"}, ["vllm_speculative_config"]),
    ({"num_speculative_tokens": 0}, ["num_speculative_tokens"]),
])
def test_speculation_settings_are_checked(values, names):
    with pytest.raises(ValidationError) as info:
        WorkerSettings(**values)
    assert all(name in str(info.value) for name in names)


def test_prefix_must_be_a_plain_name():
    with pytest.raises(ValidationError):
        ApiSettings(prefix="a b:{c}")


def test_worker_names_are_unique_per_instance():
    assert WorkerSettings().worker_name != WorkerSettings().worker_name


@pytest.mark.parametrize("params", [{"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
                                    {"max_tokens": 0}, {"stop": [""]}, {"temprature": 1}])
def test_sampling_params_reject_bad_values(params):
    with pytest.raises(ValidationError):
        SamplingParams(**params)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=None).stop == []


def test_a_section_is_made_once_and_again_when_a_field_changed():
    settings = WorkerSettings(_env_file=None)
    section = settings.speculative
    assert settings.speculative is section  # not a new object on every access
    copy = settings.model_copy(update={"num_speculative_tokens": 7})
    assert copy.speculative.num_tokens == 7
    assert settings.speculative is section and section.num_tokens != 7
    settings.num_speculative_tokens = 3
    assert settings.speculative.num_tokens == 3


def test_the_configuration_page_names_every_setting():
    """docs/configuration.md lists every process's settings by their environment variable."""
    from pathlib import Path

    from shared import settings

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    missing = sorted({f"STREAMQ_{(field.alias or name).upper()}"
                      for cls in (settings.ApiSettings, settings.WorkerSettings, settings.SchedulerSettings)
                      for name, field in cls.model_fields.items()
                      if f"STREAMQ_{(field.alias or name).upper()}" not in page})
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_the_configuration_page_says_which_process_reads_each_setting():
    """Each row of docs/configuration.md's table has a "read by" cell, and a setting of one
    process's class names that process there (one of CommonSettings' names at least one)."""
    import re
    from pathlib import Path

    from shared import settings

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| `")]
    assert rows and all(len(row) == 4 for row in rows), "every row: variable | default | read by | meaning"
    read_by = {name: row[2] for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0])}
    assert all(cell.strip() for cell in read_by.values())
    processes = {settings.ApiSettings: "api", settings.WorkerSettings: "worker", settings.SchedulerSettings: "scheduler"}
    common = set(settings.CommonSettings.model_fields)
    wrong = []
    for cls, process in processes.items():
        for name, field in cls.model_fields.items():
            cell = read_by.get(f"STREAMQ_{(field.alias or name).upper()}") or read_by.get((field.alias or name).upper())
            said = set(re.findall(r"\b(api|worker|scheduler)\b", cell or ""))
            if name in common and not said or name not in common and process not in said:
                wrong.append(f"{name}: {cell!r}")
    assert not wrong, f"docs/configuration.md's \"read by\" misses the process that reads {wrong}"
