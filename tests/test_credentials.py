"""Credentials: taken at the edge, sent to their own server, stored nowhere."""

from __future__ import annotations

import base64
import sqlite3

import pytest

from cancelwatch.collectors.sources.credentials import CredentialError, api_key, auth_headers, split_userinfo
from cancelwatch.collectors.recording.session import PreflightError, parse_targets
from cancelwatch.collectors.sources.vllm import VllmMetricsSource
from tests.conftest import FIXTURES, cli
from tests.fixture_server import MetricsFixtureServer

IDLE = FIXTURES / "vllm" / "0.32" / "idle.txt"
PASSWORD = "pw-9f3a77c1e2"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("url, clean, header", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000", None),
    (f"http://ops:{PASSWORD}@127.0.0.1:8000/v1?x=1", "http://127.0.0.1:8000/v1?x=1", basic("ops", PASSWORD)),
    ("https://ops@gw.internal", "https://gw.internal", basic("ops", "")),
    (f"http://ops:{PASSWORD}@[::1]:9000", "http://[::1]:9000", basic("ops", PASSWORD)),
])
def test_userinfo_is_split_off_the_url(url, clean, header):
    assert split_userinfo(url) == (clean, header)


def test_the_key_comes_from_the_named_variable_else_the_defaults_in_order():
    assert api_key(None, {}) == (None, None)
    assert api_key(None, {"OPENAI_API_KEY": "b"}) == ("b", "OPENAI_API_KEY")
    assert api_key(None, {"OPENAI_API_KEY": "b", "VLLM_API_KEY": "a"}) == ("a", "VLLM_API_KEY")
    assert api_key("MY_KEY", {"MY_KEY": "c", "VLLM_API_KEY": "a"}) == ("c", "MY_KEY")
    with pytest.raises(CredentialError) as err:
        api_key("MY_KEY", {"VLLM_API_KEY": "a"})  # named and unset: no quiet fallback to another key
    assert "MY_KEY is not set" in str(err.value) and "\n" not in str(err.value)
    assert auth_headers("k", basic("u", "p")) == {"Authorization": "Bearer k"}
    assert auth_headers(None, basic("u", "p")) == {"Authorization": basic("u", "p")}
    assert auth_headers(None, None) == {}


def test_targets_keep_their_credentials_out_of_what_is_stored():
    (t,) = parse_targets([f"a=http://ops:{PASSWORD}@127.0.0.1:8000/"])
    assert t.label == "a" and t.url == "http://127.0.0.1:8000" and PASSWORD not in repr(t)
    assert PASSWORD in t.source_url
    with pytest.raises(PreflightError) as err:
        parse_targets([f"ftp://ops:{PASSWORD}@127.0.0.1:8000"])
    assert PASSWORD not in str(err.value)


def test_a_metrics_url_with_credentials_is_read_with_them_and_named_without():
    with MetricsFixtureServer(IDLE, require_auth=basic("ops", PASSWORD)) as server:
        given = server.url.replace("http://", f"http://ops:{PASSWORD}@")
        src = VllmMetricsSource(given, "t0")
        assert src.check() is None and src.sample(0, 0)
        assert PASSWORD not in src.metrics_url and PASSWORD not in src.base_url
        src.close()
        bare = VllmMetricsSource(server.url, "t0")
        problem = bare.check()  # refused without them: the message names the URL, no credentials to leak
        assert problem is not None and "401" in problem
        bare.close()
        assert server.auths[0] == basic("ops", PASSWORD) and server.auths[-1] is None


def test_sample_through_a_url_with_credentials_stores_none_of_them(tmp_path):
    store = tmp_path / "cw.db"
    with MetricsFixtureServer(IDLE, require_auth=basic("ops", PASSWORD)) as server:
        given = server.url.replace("http://", f"http://ops:{PASSWORD}@")
        res = cli("sample", "--target", given, "--duration", "1", "--nvml", "off", "--store", str(store))
    assert res.returncode == 0, res.stdout + res.stderr
    assert PASSWORD not in res.stdout + res.stderr
    for path in tmp_path.iterdir():
        assert PASSWORD.encode() not in path.read_bytes(), path
    with sqlite3.connect(store) as db:
        (n,) = db.execute("select count(*) from samples").fetchone()
    assert n > 0  # it did read the server, with the credentials


def test_record_names_a_missing_key_variable_in_one_line(tmp_path):
    res = cli("record", "--target", "http://127.0.0.1:9", "--api-key-env", "CW_SURELY_UNSET_KEY",
              "--store", str(tmp_path / "cw.db"))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "CW_SURELY_UNSET_KEY is not set" in res.stderr, res.stderr


def test_what_the_run_stores_of_a_target_has_no_credentials():
    from dataclasses import asdict

    (t,) = parse_targets([f"http://ops:{PASSWORD}@127.0.0.1:8000"])
    assert asdict(t) == {"label": "t0", "url": "http://127.0.0.1:8000", "family": None}  # the family: set by its sources


def test_encoded_credentials_are_decoded_and_an_unsplittable_url_is_refused_without_showing_it():
    assert split_userinfo("http://ops:p%40ss%2Fw@127.0.0.1:8000") == ("http://127.0.0.1:8000", basic("ops", "p@ss/w"))
    with pytest.raises(CredentialError):
        split_userinfo(f"http://ops:{PASSWORD}/x@127.0.0.1:8000")  # a '/' in the password, unencoded
    with pytest.raises(PreflightError) as err:
        parse_targets([f"http://ops:{PASSWORD}/x@127.0.0.1:8000"])
    assert PASSWORD not in str(err.value) and "\n" not in str(err.value)
    (t,) = parse_targets([f"a=http://ops:{PASSWORD}=x@127.0.0.1:8000"])  # '=' in the password: label is 'a'
    assert t.label == "a" and t.url == "http://127.0.0.1:8000"


# --- an engine's command line as it is kept (collectors/engines/command_line.py) ---

def test_an_engine_command_line_is_kept_with_every_credential_redacted():
    from cancelwatch.collectors.engines.command_line import REDACTED, redact_command, scrub

    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--port", "8000",
            "--api-key", "k1-secret", "k2-secret", "--max-num-batched-tokens", "512", "--hf-token=hf_abcdef",
            "--tokenizer", "/tok", "--long-prefill-token-threshold", "4",
            "--kv-transfer-config", '{"url": "http://u:pw9x@10.0.0.1:1234/x", "kv_role": "kv_both"}',
            "--watermark-config", '{"key": 123456789, "gamma": 0.25}', "--watermark-config.key", "98765",
            "--hf-overrides", '{"token": "hf_tok123", "gamma": 0.25}',
            "--otlp-traces-endpoint", "https://collector:4318/v1?accessToken=tq12&x=1",
            "--speculative-config", "https://a:p/w@host/m", "--client-secret", "-12345",
            "--compilation-config.pass_config.fuse_norm_quant", "true", "--enable-log-requests"]
    kept, secrets = redact_command(argv)
    assert secrets == {"k1-secret", "k2-secret", "hf_abcdef", "u:pw9x", '{"key": 123456789, "gamma": 0.25}',
                       "98765", "hf_tok123", "tq12", "a:p/w", "-12345"}
    # vLLM's own sensitive fields lose their whole value, as in vLLM's log; other JSON its secret keys
    assert kept[kept.index("--watermark-config") + 1] == REDACTED
    text = " ".join(kept)
    assert not any(s in text for s in secrets), text
    assert len(kept) == len(argv)  # argument for argument: the kept line still reads as the one run
    assert kept[kept.index("--api-key") + 1: kept.index("--api-key") + 3] == [REDACTED, REDACTED]
    # what only looks like a secret is kept: a word inside a flag's name is not its last word
    for flag, value in (("--max-num-batched-tokens", "512"), ("--tokenizer", "/tok"),
                        ("--long-prefill-token-threshold", "4"),
                        ("--compilation-config.pass_config.fuse_norm_quant", "true")):
        assert kept[kept.index(flag) + 1] == value, flag
    assert f"--hf-token={REDACTED}" in kept and "--enable-log-requests" in kept
    assert f"http://{REDACTED}@10.0.0.1:1234/x" in text and '"kv_role": "kv_both"' in text
    assert '"gamma": 0.25' in text and f"?accessToken={REDACTED}&x=1" in text
    assert scrub("error: unrecognized arguments: --api-keyy k1-secret (u:pw9x) 4 true", secrets) == \
        f"error: unrecognized arguments: --api-keyy {REDACTED} ({REDACTED}) 4 true"
    # nothing to redact: the same line back, JSON spelled as given
    plain = ["python", "-m", "x", "--port", "1", "--served-model-name", "tiny", "--hf-overrides", '{"a":1}']
    assert redact_command(plain) == (plain, set())
