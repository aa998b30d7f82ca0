"""The gateways of the matrix (collectors/engines/gateways.py): what each config binds to, and each one that is
installed here started from the config the matrix writes and proxying a request (nginx and HAProxy are
installed by `make test`; Caddy, Apache, Envoy, Traefik, LiteLLM and vllm-router by `make matrix`: skipped
where they are not, saying so). Through the embedded engine they run in tests/test_gateways_engine.py and
`make matrix`."""

from __future__ import annotations

import http.server
import threading
import urllib.request
from pathlib import Path

import pytest

from cancelwatch.collectors.engines import gateways as gw_mod
from tests.conftest import free_port

NAMES = [name for name, g in gw_mod.GATEWAYS.items() if not g.engine]  # an engine row has no upstream to proxy


class _Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def upstream():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("name", NAMES)
def test_every_config_listens_on_loopback_only_and_names_its_upstream(name, tmp_path):
    port, up = 41001, 41002
    cfg = gw_mod.GATEWAYS[name].config(tmp_path, port, up)
    text = "\n".join(cfg.files.values()) + " " + " ".join(cfg.argv)
    assert "0.0.0.0" not in text and "[::]" not in text and "*:" not in text, text
    assert str(up) in text, text  # the upstream it was given, nothing else
    assert "127.0.0.1" in text and str(port) in text, text  # it listens where it was told, on loopback


@pytest.mark.parametrize("name", NAMES)
def test_each_installed_gateway_starts_from_its_config_and_proxies(name, tmp_path, upstream):
    g = gw_mod.GATEWAYS[name]
    if g.binary() is None:
        pytest.skip(f"{g.product} is not installed here: {g.install}")
    if name == "litellm":
        pytest.skip("LiteLLM routes /v1 to a model, not a plain GET: through the engine in make matrix")
    port = free_port()
    running = gw_mod.start(g, tmp_path / name, port, upstream, timeout_s=60)
    try:
        assert running.version and running.version != "unknown", running
        path = "/v1/models"  # passed to the upstream by each (vllm-router answers /health itself)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as resp:
            assert resp.status == 200 and b'"ok"' in resp.read(), name
    finally:
        gw_mod.stop(running)
    assert running.proc.poll() is not None, f"{name} left running"


@pytest.mark.parametrize("name", ["nginx", "haproxy"])
def test_a_gateway_started_in_a_relative_work_dir_finds_its_config(name, tmp_path, monkeypatch, upstream):
    # `make matrix` runs with the default home `.cancelwatch`: a relative work dir, and each gateway runs
    # inside it, so a config path written relative would be looked for under itself (nginx exited at start)
    g = gw_mod.GATEWAYS[name]
    if g.binary() is None:
        pytest.skip(f"{g.product} is not installed here: {g.install}")
    monkeypatch.chdir(tmp_path)
    port = free_port()
    running = gw_mod.start(g, Path(".cancelwatch/matrix") / name, port, upstream)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as resp:
            assert resp.status == 200 and b'"ok"' in resp.read(), name
    finally:
        gw_mod.stop(running)


def test_a_gateway_that_waits_for_its_upstream_starts_before_the_tap_behind_it(tmp_path):
    # vllm-router listens only once its worker answers /health; in the matrix that worker is the tap in front
    # of the engine, which the recording starts after the gateway: a stand-in answers until it listens
    g = gw_mod.GATEWAYS["vllm-router"]
    if g.binary() is None:
        pytest.skip(f"{g.product} is not installed here: {g.install}")
    up = free_port()
    running = gw_mod.start(g, tmp_path / "vr", free_port(), up, timeout_s=60)
    try:
        import socket
        with socket.socket() as s:  # the stand-in is gone: the tap can take the port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", up))
    finally:
        gw_mod.stop(running)


def test_a_gateway_the_matrix_does_not_know_is_one_line_and_nothing_starts(tmp_path):
    from tests.conftest import cli

    res = cli("matrix", "--gateway", "squid", "--out", str(tmp_path / "docs"), "--store", str(tmp_path / "m.db"),
              home=tmp_path / "home")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "'squid'" in lines[0] and "nginx-ignore-abort" in lines[0], res.stderr
    assert "starting the embedded engine" not in res.stdout and not (tmp_path / "docs").exists()


def test_a_gateway_that_is_not_installed_is_named_with_how_to_install_it(monkeypatch):
    import dataclasses

    import typer

    from cancelwatch.matrix_commands import _chosen

    missing = dataclasses.replace(gw_mod.GATEWAYS["envoy"], binary=lambda: None)
    monkeypatch.setitem(gw_mod.GATEWAYS, "envoy", missing)
    with pytest.raises(typer.Exit) as exc:
        _chosen(gw_mod, ["nginx,envoy"])
    assert exc.value.exit_code == 2
    with pytest.raises(gw_mod.GatewayError, match="Envoy is not installed here: make matrix installs it"):
        gw_mod.start(missing, Path("unused"), free_port(), free_port())


def test_an_app_that_does_not_start_is_one_line_and_nothing_is_left_running(tmp_path):
    """An app asked for a variant it has not exits at its start: one line naming the fix, nothing listening; the
    matrix turns the GatewayError into that line and exit 2 (matrix_commands)."""
    import dataclasses

    broken = dataclasses.replace(gw_mod.GATEWAYS["app-fastapi"], name="app-broken", config=gw_mod._app("nonsense"))
    if broken.binary() is None:
        pytest.skip(f"the apps run in the embedded engine's venv: {broken.install}")
    port = free_port()
    with pytest.raises(gw_mod.GatewayError) as exc:
        gw_mod.start(broken, tmp_path / "app", port, free_port())
    said = str(exc.value)
    assert "\n" not in said and "app-broken exited at start" in said, said
    assert "CANCELWATCH_APP_KIND='nonsense' is no app here: use one of plain, base_http" in said, said
    assert not gw_mod._listening(port)
