"""An engine behind an API key: the key reaches that engine and nothing else keeps it.

A real vLLM started the README's way, `cancelwatch engine up -- --api-key KEY`, guards /v1/*; the key
is on its command line, and cancelwatch keeps that command line (the engine state file, the run's
facts) only with the key redacted. `record --api-key-env VAR` must get its cancels
through (the engine logs and aborts them: the key was sent), and afterwards the key, and the password
of a target URL given as http://user:password@host, must be absent from everything the tool wrote:
the store (every file of it), the Parquet export, the HTML report, a rendered notebook and the
tool's own output. A missing or refused key is one line that names the fix.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from cancelwatch.collectors.engines.command_line import REDACTED
from cancelwatch.collectors.engines.lifecycle import read_state
from cancelwatch.runstore.reader import load_run
from tests import conftest
from tests.conftest import SHORT, _stop_engine, cli, free_port

pytestmark = pytest.mark.engine

KEY = f"sk-cw-{uuid.uuid4().hex}"
PASSWORD = f"pw-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def keyed_engine(request, tmp_path_factory):
    """The embedded engine started as the README says: `cancelwatch engine up [...] -- --api-key KEY`."""
    home = tmp_path_factory.mktemp("keyed-home")
    port = free_port()
    # a module fixture runs before the per-test guard knows the test: this module is marked `engine`
    conftest._current["engine"] = request.node.get_closest_marker("engine") is not None
    up = run_cli("engine", "up", "--port", str(port), "--", "--api-key", KEY, env={}, home=home, timeout=900)
    state = read_state(home, port)
    try:
        assert up.returncode == 0 and state is not None, up.stdout[-2000:] + up.stderr[-2000:]
        assert KEY not in up.stdout + up.stderr
        yield home, state
    finally:
        if state is not None:
            left = _stop_engine(home, state)
            assert not left, f"engine down left processes behind: {left}"


def run_cli(*args, env: dict[str, str | None], home: Path, timeout: float = 300):
    saved = {k: os.environ.get(k) for k in [*env, "VLLM_API_KEY", "OPENAI_API_KEY"]}
    try:
        for k in ("VLLM_API_KEY", "OPENAI_API_KEY"):
            os.environ.pop(k, None)
        for k, v in env.items():
            if v is not None:
                os.environ[k] = v
        return cli(*args, home=home, timeout=timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_password(url: str) -> str:
    return url.replace("http://", f"http://cwuser:{PASSWORD}@")


def test_the_engine_wants_the_key(keyed_engine):
    _, state = keyed_engine
    assert httpx.get(state.url + "/v1/models", timeout=10).status_code == 401
    ok = httpx.get(state.url + "/v1/models", timeout=10, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    # the key went on the engine's command line (the README's way) and is kept there redacted only
    cmdline = psutil.Process(state.pid).cmdline()
    assert cmdline[cmdline.index("--api-key") + 1] == KEY
    assert state.command[state.command.index("--api-key") + 1] == REDACTED
    home = keyed_engine[0]
    assert all(KEY.encode() not in p.read_bytes() for p in home.rglob("*") if p.is_file() and
               p.suffix in (".json", ".log"))  # nor in the engine's state or its log (vLLM writes *** there)


def test_a_missing_or_refused_key_is_one_line_naming_the_fix(keyed_engine, tmp_path):
    home, state = keyed_engine
    store = tmp_path / "cw.db"
    args = ("record", "--target", state.url, "--scenario", "decode", "--store", str(store))
    none = run_cli(*args, env={}, home=home, timeout=120)
    assert none.returncode == 2, none.stdout + none.stderr
    line = none.stderr.strip()
    assert "\n" not in line and "401" in line and "--api-key-env" in line, line
    unset = run_cli(*args, "--api-key-env", "CW_TEST_KEY", env={}, home=home, timeout=120)
    assert unset.returncode == 2 and "CW_TEST_KEY is not set" in unset.stderr and "\n" not in unset.stderr.strip()
    wrong = run_cli(*args, "--api-key-env", "CW_TEST_KEY", env={"CW_TEST_KEY": "sk-wrong"}, home=home, timeout=120)
    assert wrong.returncode == 2 and "CW_TEST_KEY was refused" in wrong.stderr, wrong.stderr
    assert "sk-wrong" not in wrong.stderr + wrong.stdout
    assert not store.exists() or "cw-" not in store.read_bytes().decode("latin-1")  # nothing was driven


def test_load_sends_the_key_and_says_in_one_line_when_it_has_none(keyed_engine):
    home, state = keyed_engine
    args = ("load", "--target", state.url, "--streams", "2", "--prompt-tokens", "20", "--max-tokens", "4")
    none = run_cli(*args, env={}, home=home, timeout=120)
    assert none.returncode == 2 and "\n" not in none.stderr.strip(), none.stdout + none.stderr
    assert "401" in none.stderr and "--api-key-env" in none.stderr, none.stderr
    keyed = run_cli(*args, "--api-key-env", "CW_TEST_KEY", env={"CW_TEST_KEY": KEY}, home=home, timeout=120)
    assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    assert keyed.stdout.count("4 chunks") == 2 and "ok" in keyed.stdout, keyed.stdout  # both streams served
    assert KEY not in keyed.stdout + keyed.stderr


def test_the_key_gets_the_cancels_through_and_is_stored_nowhere(keyed_engine, tmp_path):
    home, state = keyed_engine
    folder = tmp_path / "run"
    folder.mkdir()
    scen = folder / "short.toml"
    scen.write_text(SHORT)
    store = folder / "cw.db"
    rec = run_cli("record", "--target", with_password(state.url), "--metrics-url", with_password(state.url),
                  "--scenario", str(scen), "--store", str(store), "--name", "keyed",
                  "--api-key-env", "CW_TEST_KEY", env={"CW_TEST_KEY": KEY}, home=home)
    assert rec.returncode in (0, 1), rec.stdout[-3000:] + rec.stderr[-3000:]
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    # the key was sent: the engine itself logged and aborted the cancels
    assert doc["cancels"] and all(c["timepoint_sources"]["engine_abort"]["source"] == "engine_log"
                                  for c in doc["cancels"] if c["verdict"] == "released"), doc
    assert any(c["verdict"] == "released" for c in doc["cancels"]), doc
    assert doc["target"] == state.url  # stored without user:password
    html = folder / "report.html"
    rep = cli("report", "latest", "--store", str(store), "--html", str(html))
    assert rep.returncode in (0, 1), rep.stderr
    export = cli("export", "latest", "--store", str(store), "--parquet", str(folder / "parquet"))
    assert export.returncode == 0, export.stderr
    protocol = cli("report", "latest", "--store", str(store), "--protocol", str(folder / "protocol.md"))
    assert protocol.returncode in (0, 1), protocol.stderr
    assert f"--api-key {REDACTED}" in (folder / "protocol.md").read_text()  # the command shown, redacted
    nb = cli("notebook", "vram_plateau", "--store", str(store), "--html", str(folder / "nb.html"),
             "--ipynb", str(folder / "nb.ipynb"), timeout=600)
    assert nb.returncode == 0, nb.stderr[-2000:]
    outputs = (rec, rep, export, protocol, nb)
    (folder / "cli-output.txt").write_text("\n".join(r.stdout + r.stderr for r in outputs))
    engine_files = [p for p in home.rglob("*") if "models" not in p.relative_to(home).parts]  # not the tiny model
    written = sorted(p for p in [*folder.rglob("*"), *engine_files] if p.is_file() and p != scen)
    names = {p.name for p in written}
    assert {"cw.db", "report.html", "protocol.md", "nb.html", "nb.ipynb", "cli-output.txt",
            f"engine-{state.port}.json", f"engine-{state.port}.log"} <= names, names
    assert any(p.suffix == ".parquet" for p in written), names
    for p in written:
        data = p.read_bytes()
        for secret in (KEY, PASSWORD):
            assert secret.encode() not in data, f"{secret[:8]}... found in {p}"
    # the run says where the credentials came from, not what they are; its facts keep the command redacted
    run = load_run(store, "latest")
    assert run.info["engine"]["auth"] == {"api_key_env": "CW_TEST_KEY"}, run.info["engine"]
    command = next(iter(run.info["engine"]["targets"].values()))["command"]
    assert command[command.index("--api-key") + 1] == REDACTED, command
