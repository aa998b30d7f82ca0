"""`watch`'s taps behind it (`--hop`) and the name of what it feeds (`--upstream-name`): a bad one is one line that
names the fix and exit 2, before anything listens or is sent. The chain at work: test_page_stop_browser.py."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import cli, free_port


@pytest.mark.parametrize("extra, said", [
    (["--hop", "app"], "is not NAME=LISTEN,UPSTREAM_URL"),
    (["--hop", "app=127.0.0.1:9,ftp://x"], "is not an http(s) URL"),
    (["--upstream-name", "my app"], "--upstream-name 'my app': use letters, digits"),
    (["--hop", "app=127.0.0.1:{listen},http://127.0.0.1:9"], "listens on 127.0.0.1:{listen} like"),
    (["--hop", "app=127.0.0.1:{other},http://127.0.0.1:{listen}"], "its upstream http://127.0.0.1:{listen} is tap"),
    (["--upstream-name", "app", "--hop", "app=127.0.0.1:{other},http://127.0.0.1:9"], "names must be unique"),
])
def test_a_bad_hop_is_one_line_and_exit_2_with_nothing_listening(tmp_path, extra, said):
    listen, other = free_port(), free_port()
    args = [a.format(listen=listen, other=other) for a in extra]
    res = cli("watch", "--listen", f"127.0.0.1:{listen}", "--upstream", "http://127.0.0.1:9", *args,
              "--store", str(tmp_path / "w.db"), "--duration", "1s")
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and said.format(listen=listen) in lines[0], lines
    for port in (listen, other):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"something listens on {port}"
    assert not (tmp_path / "w.db").exists()
