"""The engine's command line (pure) and the tiny model it serves."""

from __future__ import annotations

import json
import subprocess

from cancelwatch.collectors.engines import vllm_server as engine_mod
from cancelwatch.collectors.engines.vllm_server import EngineShape, build_command


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_cpu_default_command_shapes_the_pool():
    cmd = build_command("/py", "/m/tiny", 8123, EngineShape(), dummy_weights=True)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(cmd, "--host") == "127.0.0.1" and flag(cmd, "--port") == "8123"
    assert flag(cmd, "--max-num-seqs") == "4"
    assert flag(cmd, "--num-gpu-blocks-override") == "64" and flag(cmd, "--block-size") == "128"
    assert flag(cmd, "--load-format") == "dummy" and "--enforce-eager" in cmd
    assert flag(cmd, "--served-model-name") == "tiny"


def test_overrides_and_extra_flags():
    shape = EngineShape(max_num_seqs=2, num_gpu_blocks=None, block_size=16)
    cmd = build_command("/py", "/m/x", 8000, shape, dummy_weights=False, extra_args=["--seed", "7"])
    assert flag(cmd, "--max-num-seqs") == "2" and flag(cmd, "--block-size") == "16"
    assert "--num-gpu-blocks-override" not in cmd and "--load-format" not in cmd
    assert cmd[-2:] == ["--seed", "7"]


def test_gpu_command_is_vllm_serve():
    cmd = build_command("/opt/vllm/bin/python", "/models/llama", 8000, EngineShape(dtype="auto"), dummy_weights=False, gpu=True)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/models/llama"]
    assert "--enforce-eager" not in cmd and flag(cmd, "--served-model-name") == "llama"


def test_tiny_model_is_built_once_and_sized_for_a_visible_kv_pool(tmp_path):
    python = engine_mod.default_engine_python()
    out = engine_mod.ensure_tiny_model(tmp_path, python)
    cfg = json.loads((out / "config.json").read_text())
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    pool = kv_bytes_per_token * EngineShape().num_gpu_blocks * EngineShape().block_size
    assert pool >= 200 * 2**20, f"KV pool of {pool / 2**20:.0f} MiB would not show as a plateau"
    assert cfg["head_dim"] >= 32  # the CPU attention backend needs it
    mtime = (out / "config.json").stat().st_mtime_ns
    assert engine_mod.ensure_tiny_model(tmp_path, python) == out
    assert (out / "config.json").stat().st_mtime_ns == mtime
    # every word is one token (the load generator relies on it)
    code = ("from transformers import AutoTokenizer; import sys; t = AutoTokenizer.from_pretrained(sys.argv[1]);"
            "print(len(t(' '.join(f'w{i}' for i in range(1450)))['input_ids']))")
    if python != engine_mod.sys.executable:
        res = subprocess.run([python, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert int(res.stdout.strip().splitlines()[-1]) in (1450, 1451)  # + BOS when the tokenizer adds it


def test_relay_command_runs_the_relay_app():
    cmd = build_command("/py", "/m/tiny", 8100, EngineShape(), dummy_weights=True, relay=True)
    assert cmd[1:3] == ["-m", "cancelwatch.collectors.engines.relay_app"] and "--enable-log-requests" not in cmd
    assert flag(cmd, "--num-gpu-blocks-override") == "64" and "--enforce-eager" in cmd


def test_the_engine_logs_each_request_only_when_asked():
    """vLLM's own default writes no per-request lines (the corpus records it so, tests/corpus/record.py)."""
    on = build_command("/py", "/m/tiny", 8000, EngineShape(), dummy_weights=True)
    off = build_command("/py", "/m/tiny", 8000, EngineShape(), dummy_weights=True, log_requests=False)
    assert "--enable-log-requests" in on and "--enable-log-requests" not in off
    assert [a for a in on if a != "--enable-log-requests"] == off
