"""What a corpus run's set-up makes certain of its cancels, whatever the rules say: the truth `known by
construction`. Worked out from the run (its ledger, the engine log's lines where the engine wrote them) and
from the facts the manifest keeps beside it: what the test proxy did with each request (when its client went,
when the proxy read the engine's answer to its end, whether it passed the disconnect on, the id it sent it
upstream under, whether it sent it again) and what each client did (a stream read to its end).

- A request whose answer the proxy read to its end before its client left lost no cancel.
- A cancel on a path that never passed it on, whose answer the proxy read to its end well past the grace
  after the client went, leaked: the engine ran it for nobody. So did one a gateway sent upstream again
  after its client left.
- A cancel on a path that passes a disconnect on (direct, or a proxy that passed this one on), whose abort
  the engine logged within the grace, was released: vLLM frees a request's blocks on abort. Without the
  request log, a stream stopped with many tokens still to make, straight to vLLM, was released too: vLLM
  aborts a disconnected stream. The race scenario is left out: its end may win either way.
- A stream its client read to the end is no cancel at all.
- A Triton scenario whose model and protocol decide it (HTTP carries no cancel, a backend that never polls,
  one that keeps its buffer; a model that polls is_cancelled every step, reached over gRPC) is what its
  scenario is built to show.
"""

from __future__ import annotations

import json

import numpy as np

MARGIN_S = 1.0  # past the grace by this much, so that no clock's rounding decides
# without the request log: a stream stopped with tokens still to make for twice (grace + margin) at the engine's
# pace cannot end within the grace. A run recorded before its pace was kept is read at the fastest seen here
FASTEST_TOKENS_S = 150.0
BEFORE_S = 0.05  # an answer the proxy read to its end this long before the client's stop lost no cancel
NOT_BY_CONSTRUCTION = {"race"}  # stops within the last tokens: the completion may win either way
TRITON_EXPECT_BUILT = {"triton_http_timeout", "triton_deaf", "triton_hoard", "triton_executing",
                       "triton_disconnect", "triton_stream_wide"}


def truths(run, *, path: str, clients: dict, proxy: dict, engine_log_read: bool, kind: str,
           pace: float | None = None) -> dict:
    """request id -> {"truth": ..., "why": ...} for the requests of `run` whose truth the set-up makes certain."""
    from cancelwatch.analysis.verdicts import run_grace_s

    if kind == "triton":
        return _triton(run)
    if kind == "matrix" and not engine_log_read:
        return {}  # its requests cross gateways that may keep them: only the engine's log can say
    out: dict[str, dict] = {}
    ledger = run.ledger
    if ledger is None or ledger.empty:
        return out
    grace = run_grace_s(run)
    t0 = run.info["started_mono_ns"]
    seen = (proxy or {}).get("requests", {})
    resubmitted = set((proxy or {}).get("resubmitted", []))
    resubmit_done, resubmit_error = (proxy or {}).get("resubmit_done_at"), (proxy or {}).get("resubmit_error")
    passed_on = set((proxy or {}).get("passed_on", []))
    minted = (proxy or {}).get("minted", {})
    to_go = 2 * (pace or FASTEST_TOKENS_S) * (grace + MARGIN_S)
    for row in ledger.itertuples(index=False):
        rid = row.request_id
        if clients.get(str(rid).split("~", 1)[0]) == "full":  # the watch renames a reused id `id~xxxxxx`
            out[rid] = {"truth": "no_cancel", "why": "its client read the answer to its end"}
            continue
        if kind != "watch" and row.role != "target":
            continue
        if row.terminal_state != "cancelled" or _nan(row.cancel_mono_ns):
            continue
        p = seen.get(rid)
        stop_s = (row.cancel_mono_ns - t0) / 1e9
        if p is not None:
            gone, done = p.get("client_gone_at"), p.get("upstream_done_at")
            if rid in resubmitted:
                # the proxy's own instants and the run's are one host's CLOCK_MONOTONIC (tests/proxies.py)
                if resubmit_error is None and resubmit_done is not None and gone is not None \
                        and resubmit_done - gone > grace + MARGIN_S:
                    out[rid] = {"truth": "leaked", "why": "the proxy passed the disconnect on, then sent the request "
                                                          f"upstream again and read it to its end "
                                                          f"{resubmit_done - gone:.1f} s after the client left"}
                continue
            # against the client's own stop, not when the proxy noticed it (a stalled proxy handles both at once)
            if done is not None and done <= row.cancel_mono_ns / 1e9 - BEFORE_S:
                out[rid] = {"truth": "no_lost_cancel", "why": f"the proxy read the engine's answer to its end "
                                                              f"{row.cancel_mono_ns / 1e9 - done:.2f} s before the "
                                                              "client's stop"}
                continue
            if p.get("leaked"):
                if gone is not None and done is not None and done - gone > grace + MARGIN_S:
                    out[rid] = {"truth": "leaked", "why": f"the proxy never passed the disconnect on: it read the "
                                                          f"engine's answer to its end {done - gone:.1f} s after the "
                                                          "client left"}
                continue
            if gone is None or rid not in passed_on:
                continue  # the proxy did not pass this one's disconnect on (or never saw the client go)
        elif path not in ("direct", "foreign"):
            continue  # a proxy that never saw the request: nothing certain
        if row.scenario in NOT_BY_CONSTRUCTION:
            continue
        words = "straight to the engine" if p is None else "through a proxy that passed this disconnect on"
        if engine_log_read:
            ev = run.events
            name = minted.get(rid, rid)
            ab = ev[(ev["kind"] == "engine_aborted") & (ev["request_id"].astype(str) == name)] if len(ev) else ev
            if len(ab):
                late = float(ab["t_s"].min()) - stop_s
                if -0.05 <= late <= grace:
                    out[rid] = {"truth": "released", "why": f"{words}: the engine logged its abort "
                                                            f"{max(late, 0) * 1000:.0f} ms after the stop"}
            continue
        if kind in ("record", "watch"):
            chunks = 0 if _nan(row.chunks) else int(row.chunks)
            if chunks == 0:
                continue  # not yet streaming: vLLM may notice the disconnect only at its first write
            n = 1 if _nan(getattr(row, "n", 1)) else int(row.n)
            max_tokens = None if _nan(row.max_tokens) else int(row.max_tokens)
            if max_tokens is None and str(rid).startswith("sdk-") and not str(rid).startswith("sdk-full"):
                max_tokens = 1200  # tests/corpus/record.py's sdk_clients
            if max_tokens is not None and max_tokens * n - chunks >= to_go:
                out[rid] = {"truth": "released", "why": f"{words}, vLLM aborts a disconnected request; "
                                                        f"{max_tokens * n - chunks} tokens were still to make, "
                                                        f"{to_go / (pace or FASTEST_TOKENS_S):.0f} s of decoding"}
    return out


def _triton(run) -> dict:
    out = {}
    ev = run.events
    for _, e in ev[ev["kind"] == "user_stop"].iterrows():
        data = json.loads(e["data"]) if isinstance(e["data"], str) else (e["data"] or {})
        scen, expect = data.get("scenario"), data.get("expect")
        if scen in TRITON_EXPECT_BUILT and expect in ("released", "leaked"):
            out[e["request_id"]] = {"truth": expect, "why": f"{scen}: the model and the protocol are built so "
                                                            "(collectors/engines/triton_models)"}
    return out


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and np.isnan(x))
