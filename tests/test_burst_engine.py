"""Burst sampling on the real engine: the scheduler source runs at --burst-hz from just before each stop
to the end of --burst-window, at --hz elsewhere; the store, the report and the verdicts take the mix."""

from __future__ import annotations

import json

import numpy as np

from cancelwatch.runstore.reader import load_run
from tests.conftest import SHORT, cli


def test_record_with_bursts_samples_fast_around_each_stop_and_judges_as_usual(engine, engine_home, tmp_path):
    scen = tmp_path / "short.toml"
    scen.write_text(SHORT)
    store = tmp_path / "cw.db"
    res = cli("record", "--target", engine.url, "--scenario", str(scen), "--store", str(store), "--hz", "20",
              "--burst-hz", "100", "--burst-window", "1.5s", home=engine_home, timeout=300)
    assert res.returncode in (0, 1), res.stdout[-3000:] + res.stderr[-3000:]
    run = load_run(store, "latest")
    assert run.info["settings"]["burst_hz"] == 100 and run.info["settings"]["burst_window_s"] == 1.5
    doc = json.loads(cli("report", "latest", "--json", "--store", str(store)).stdout)
    assert len(doc["cancels"]) == 2
    assert sum(c["verdict"] == "released" for c in doc["cancels"]) >= 1, doc["cancels"]
    sc = run.scrapes[(run.scrapes["source"] == "vllm") & (run.scrapes["ok"] == 1)].sort_values("t_s")
    t = sc["t_s"].to_numpy()
    stops = [c["timepoints"]["user_stop"] for c in doc["cancels"]]
    in_burst = np.zeros(len(t), dtype=bool)
    for s in stops:
        in_burst |= (t > s) & (t < s + 1.4)
    gaps_in = np.diff(t)[in_burst[1:] & in_burst[:-1]]
    gaps_out = np.diff(t)[~in_burst[1:] & ~in_burst[:-1]]
    assert len(gaps_in) >= 100, len(gaps_in)  # ~140 reads in 2 x 1.4 s
    assert 0.007 <= float(np.median(gaps_in)) <= 0.013, np.median(gaps_in)
    assert 0.045 <= float(np.median(gaps_out)) <= 0.055, np.median(gaps_out)
    # the process memory source was not lifted
    mem = run.scrapes[(run.scrapes["source"] == "process") & (run.scrapes["ok"] == 1)]
    if len(mem) > 2:
        assert float(np.median(np.diff(np.sort(mem["t_s"].to_numpy())))) >= 0.045
    # left_scheduler is located to within a burst tick of the first sample that shows the request gone
    for c in doc["cancels"]:
        tp = c["timepoints"]
        if c["verdict"] == "released" and tp["engine_abort"] is not None:
            assert tp["left_scheduler"] - tp["engine_abort"] < 0.25, tp


def test_a_burst_rate_that_is_not_a_multiple_of_hz_is_one_line(tmp_path):
    res = cli("record", "--target", "http://127.0.0.1:9", "--hz", "20", "--burst-hz", "70",
              "--store", str(tmp_path / "cw.db"))
    assert res.returncode == 2
    assert "--burst-hz 70 must be a whole multiple of --hz 20" in res.stderr and "\n" not in res.stderr.strip()
