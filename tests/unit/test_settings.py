import re

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
                      for cls in (settings.ApiSettings, settings.WorkerSettings, settings.SchedulerSettings,
                                  settings.ServeSettings)
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


def _configuration_page() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()


def _setting_names() -> set[str]:
    """Every environment variable the settings classes read: STREAMQ_<field or alias>, and the
    validation aliases (REDIS_URL)."""
    from pydantic import AliasChoices

    from shared import settings

    names = set()
    for cls in (settings.ApiSettings, settings.WorkerSettings, settings.SchedulerSettings, settings.ServeSettings):
        for name, field in cls.model_fields.items():
            names.add(f"STREAMQ_{(field.alias or name).upper()}")
            if isinstance(field.validation_alias, AliasChoices):
                names |= {c for c in field.validation_alias.choices if isinstance(c, str) and c.isupper()}
    return names


def _is_environ(node) -> bool:
    import ast

    return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and node.id == "environ"


def _environment_reads(path) -> set[str]:
    """The environment variables a module reads: the literal first argument of `os.getenv(...)`,
    `<...>environ.get/setdefault/pop(...)`, `<...>environ[...]` or `... in <...>environ`, and the
    names of a module-level tuple a comprehension or loop hands to one of those."""
    import ast

    tree = ast.parse(path.read_text())
    constants = {target.id: [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
                 for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List))
                 for target in node.targets if isinstance(target, ast.Name)}
    loops = {}
    for node in ast.walk(tree):
        for loop in getattr(node, "generators", [node] if isinstance(node, ast.For) else []):
            if isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Name) and loop.iter.id in constants:
                loops[loop.target.id] = constants[loop.iter.id]
    found: set[str] = set()

    def add(arg) -> None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.add(arg.value)
        elif isinstance(arg, ast.Name):
            found.update(loops.get(arg.id, []))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "getenv"
                    or isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop") and _is_environ(func.value)):
                add(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            add(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            add(node.left)
    return {name for name in found if isinstance(name, str) and re.fullmatch(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)+", name)}


def _code_environment_reads() -> dict[str, list[str]]:
    """Each environment variable the code of the five packages reads, and the modules that read it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    reads: dict[str, list[str]] = {}
    for package in ("api", "worker", "scheduler", "shared", "streamq"):
        for path in sorted((root / package).rglob("*.py")):
            for name in _environment_reads(path):
                reads.setdefault(name, []).append(str(path.relative_to(root)))
    return reads


# Names the code reads from an `environ` that configuration.md need not list, each with why.
NOT_SETTINGS = {
    "PATH_INFO",  # worker/service/metrics.py: the WSGI request's environ (the path asked for), not the process's
}


# Variables the code reads where the scan does not see it, each with where.
UNSEEN_READS = {
    "GLIBC_TUNABLES",  # worker/model/openmp.py: setdefault on a copy of os.environ (preload_env's env)
}


def test_the_environment_scan_finds_the_reads():
    """The scan sees a literal read, a tuple of names handed to one, and leaves writes out."""
    reads = _code_environment_reads()
    assert "shared/tracing.py" in reads["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]
    assert "shared/tracing.py" in reads["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]  # through _ENDPOINTS
    assert "TQDM_DISABLE" not in reads  # shared/logs.py sets it, for the libraries


def test_every_environment_variable_the_code_reads_is_on_the_configuration_page():
    """Read through os.environ or os.getenv (OTEL_*, XDG_CACHE_HOME, ...): the page names it, or
    NOT_SETTINGS says why it need not."""
    page = _configuration_page()
    missing = {name: where for name, where in _code_environment_reads().items()
               if f"`{name}`" not in page and name not in NOT_SETTINGS}
    assert not missing, f"docs/configuration.md does not name these variables the code reads: {missing}"


def test_the_configuration_page_names_no_setting_that_does_not_exist():
    """Every STREAMQ_* name on the page, and every variable a row of its tables is about, is a
    setting or a variable the code reads."""
    page = _configuration_page()
    known = _setting_names() | set(_code_environment_reads()) | UNSEEN_READS
    named = set(re.findall(r"\bSTREAMQ_[A-Z0-9_]*[A-Z0-9]\b", page))
    rows = [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `")]
    named |= {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}
    unknown = sorted(named - known)
    assert not unknown, f"docs/configuration.md names settings that do not exist: {unknown}"
