"""The Lua scripts are files of shared/lua/, each with its header, and none is left in Python
(shared/scripts.py); their runs against Redis are tests/integration/test_scripts.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared import scripts
from shared.request_record import LUA_NAMES

ROOT = Path(__file__).resolve().parents[2]


def test_no_python_file_of_the_packages_holds_lua():
    holding = [str(path.relative_to(ROOT)) for package in ("api", "shared", "worker", "scheduler", "streamq")
               for path in sorted((ROOT / package).rglob("*.py")) if "redis.call" in path.read_text()]
    assert not holding, f"Lua belongs in shared/lua/: {holding}"


@pytest.mark.parametrize("name", [n for n in scripts.names() if not scripts.is_library(n)])
def test_a_script_s_header_names_each_key_and_value_it_takes_and_what_it_returns(name):
    header = "\n".join(scripts.header(name))
    assert re.search(r"^-- KEYS\[1[].]", header, re.MULTILINE), header
    assert re.search(r"^-- ARGV\[1[].]", header, re.MULTILINE), header
    assert re.search(r"^-- Returns", header, re.MULTILINE), header
    # Each KEYS[i] and ARGV[i] the script reads has its line in the header (KEYS[3..] covers KEYS[5]).
    body = scripts.text(name)[len(header):]
    for kind in ("KEYS", "ARGV"):
        said = [int(i) for i in re.findall(rf"^-- {kind}\[(\d+)", header, re.MULTILINE)]
        read = [int(i) for i in re.findall(rf"{kind}\[(\d+)\]", body)]
        open_ended = re.search(rf"^-- {kind}\[\d+\.\.\]", header, re.MULTILINE)
        assert all(i in said or (open_ended and i > max(said)) for i in read), (kind, sorted(set(read)), said)


@pytest.mark.parametrize("name", [n for n in scripts.names() if scripts.is_library(n)])
def test_a_library_says_what_it_defines_and_is_never_run_alone(name):
    header = "\n".join(scripts.header(name))
    assert "KEYS, ARGV: none of its own" in header and "-- Returns: nothing" in header, header
    for function in re.findall(r"^local function (\w+)", scripts.text(name), re.MULTILINE):
        assert f"{function}(" in header, f"{name}.lua's header does not say what {function} does"
    with pytest.raises(ValueError, match="library"):
        scripts.register(None, name)


def test_each_library_is_used_and_comes_before_its_user_once():
    used = {u for n in scripts.names() for u in scripts.uses(n)}
    assert {n for n in scripts.names() if scripts.is_library(n)} <= used
    source = scripts.source("intake_drop")
    assert source.index("local function group_info") < source.index("local function abandoned") \
        < source.index("local group, live")
    assert source.count("local function group_info") == 1
    decide = scripts.source("requeue_decide")  # names, then finish (which uses them), then the script
    assert decide.startswith(LUA_NAMES) and decide.count(LUA_NAMES) == 1
    assert "local EVENT_FIELD = 'e'" in decide and decide.index("local function finish") < decide.index("order(id)")
