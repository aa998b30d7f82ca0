"""Scenario files: validated before any request is sent."""

from __future__ import annotations

import pytest

from cancelwatch.collectors.cancels.scenarios import APIS, BUILTIN, MODES, SUITES, TRIGGERS, ScenarioError, load_file, resolve
from tests.conftest import cli


def write(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_default_suite_has_every_builtin():
    assert [s.name for s in resolve("default")] == SUITES["default"] == list(BUILTIN)
    # the built-ins cover every way a cancel can be triggered, sent and delivered, and each says what it proves
    builtins = list(BUILTIN.values())
    assert {s.trigger for s in builtins} == set(TRIGGERS)
    assert {s.mode for s in builtins} == set(MODES)
    assert {s.api for s in builtins} == set(APIS)
    assert {s.stream for s in builtins} == {True, False}
    assert all(s.proves for s in builtins), [s.name for s in builtins if not s.proves]
    assert [s.name for s in resolve("decode,race")] == ["decode", "race"]


def test_a_user_file_loads(tmp_path):
    p = write(tmp_path, '[[scenario]]\nname = "mine"\ntrigger = "after_ms"\ntrigger_value = 300\nrepeats = 2\n')
    (s,) = load_file(p)
    assert (s.name, s.trigger, s.trigger_value, s.repeats) == ("mine", "after_ms", 300, 2)


@pytest.mark.parametrize(
    "body, key",
    [
        ('[[scenario]]\nname = "x"\nmax_tokenz = 5\n', "max_tokenz"),
        ('[[scenario]]\nname = "x"\ntrigger = "later"\n', "trigger"),
        ('[[scenario]]\nname = "x"\nmax_tokens = "many"\n', "max_tokens"),
        ('[[scenario]]\nname = "x"\nconcurrency = 1\ncancel_count = 3\n', "cancel_count"),
        ('[[scenario]]\nname = "x"\nmode = "timeout"\n', "stream"),
        ('[[scenario]]\nname = "x"\nmode = "explicit"\n', "mode"),
        ('[[scenario]]\ntrigger = "after_ms"\n', "name"),
        ('[scenarios]\nname = "x"\n', "scenarios"),
    ],
)
def test_bad_files_name_the_key(tmp_path, body, key):
    with pytest.raises(ScenarioError, match=f"'{key}'"):
        load_file(write(tmp_path, body))


def test_bad_file_exits_2_before_any_request(tmp_path):
    p = write(tmp_path, '[[scenario]]\nname = "x"\nmax_tokenz = 5\n')
    store = tmp_path / "cw.db"
    # the target is unreachable on purpose: the file error must come first
    res = cli("record", "--target", "http://127.0.0.1:9", "--scenario", str(p), "--store", str(store), home=tmp_path)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_tokenz" in lines[0]
    assert not store.exists()
    res = cli("record", "--target", "http://127.0.0.1:9", "--scenario", "nope", home=tmp_path)
    assert res.returncode == 2 and "neither a suite" in res.stderr
