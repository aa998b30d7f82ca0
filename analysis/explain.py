""""Why is GPU memory still high?": two or three plain sentences, with the run's own numbers, for
someone who will never read a metric name."""

from __future__ import annotations

import math

import numpy as np

from cancelwatch.analysis.cancel_table import verdict_counts
from cancelwatch.analysis.traces import GiB, memory_traces, metric_traces
from cancelwatch.analysis.verdicts import LOST_CANCEL_RULES, TRITON, VLLM, CancelVerdict, family_of
from cancelwatch.runstore.reader import Run

WHAT = {"nvml": "GPU memory in use", "process": "the engine's memory", "none": "memory"}
# the rules of a vLLM cancel that never reached the engine (no abort in its log)
LOST_CANCEL = LOST_CANCEL_RULES | {"entered_after_stop"}


def _level(t: np.ndarray, v: np.ndarray, lo: float, hi: float) -> float | None:
    sel = (t >= lo) & (t < hi) & ~np.isnan(v)
    return float(np.median(v[sel])) if sel.any() else None


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f} GiB"


def _percent(ratio: float | None) -> str:
    """A ratio (0..1) as a percent string."""
    return "n/a" if ratio is None else f"{100 * ratio:.0f} %"


FLAT = {
    VLLM: ("that number stays flat because vLLM reserves its KV-cache pool when it starts and keeps it, "
             "whether requests use it or not."),
    TRITON: ("that number stays flat because the server keeps its processes (the Python backend's stubs and "
               "their allocator) whether requests run or not: it does not show whether the request stopped."),
}


def memory_story(run: Run, verdicts: list[CancelVerdict], cancel: CancelVerdict | None = None) -> list[str]:
    """For one cancel (or, without one, the whole run): what reserved memory did, what KV usage did,
    and which requests were released."""
    kind, mem = memory_traces(run)
    held = [tr for role, tr in mem if role in ("used", "rss")]
    kv = metric_traces(run, "kv_cache_usage_ratio")
    if cancel is not None:
        return _cancel_memory_story(family_of(run), kind, held, kv, cancel)
    return _run_memory_story(family_of(run), kind, held, kv, verdicts)


def _cancel_memory_story(engine: str, kind: str, held: list, kv: list, cancel: CancelVerdict) -> list[str]:
    """memory_story of one cancel: reserved memory around its stop, then the KV share, then the verdict."""
    sentences = []
    t_stop = cancel.timepoints["user_stop"]
    t_after = cancel.timepoints.get("left_scheduler") or (cancel.timepoints.get("engine_abort") or t_stop) + 2.0
    target = cancel.evidence.metrics_target
    kv_tr = next((k for k in kv if k.target == target), kv[0] if kv else None)
    mem_before = sum(x for x in (_level(tr.t, tr.v, t_stop - 2.0, t_stop) for tr in held) if x is not None) if held else None
    mem_after = sum(x for x in (_level(tr.t, tr.v, t_after, t_after + 2.0) for tr in held) if x is not None) if held else None
    kv_before = cancel.evidence.kv_before
    kv_after = cancel.evidence.kv_after
    if kv_after is None and kv_tr is not None:
        kv_after = _level(kv_tr.t, kv_tr.v, t_after, t_after + 0.5)
    if held and mem_before and mem_after:
        change = 100 * (mem_after - mem_before) / mem_before
        sentences.append(
            f"When the user pressed Stop at {t_stop:.1f} s, {WHAT[kind]} was {_gib(mem_before)}, and after the "
            f"cancel it was {_gib(mem_after)} ({change:+.1f} %): {FLAT[engine]}")
    if engine == TRITON:
        if cancel.phase_at_cancel == "queued":
            sentences.append("The request was still waiting in the server's queue when it was cancelled: the core "
                             "dropped it there, and it never reached the model.")
        else:
            sentences.append("What shows whether it stopped is the server's own evidence: the model's log line "
                             "and its count of active requests, not the memory line.")
    elif cancel.phase_at_cancel == "queued":
        sentences.append(
            "The request was still waiting in the queue when it was cancelled, so it held no KV-cache space: "
            f"the share of the pool in use stayed at {_percent(kv_before)}, and its place in the queue went to the next request.")
    elif kv_before is not None and not math.isnan(kv_before):
        sentences.append(_kv_share_sentence(cancel, kv_before, kv_after))
    sentences.append(_verdict_sentence(cancel))
    return sentences


def _kv_share_sentence(cancel: CancelVerdict, kv_before: float, kv_after: float | None) -> str:
    went = (f"Inside that reserved pool, the share holding requests went from {_percent(kv_before)} to "
            f"{_percent(kv_after)}")
    if cancel.verdict == "released" and cancel.evidence.foreign_requests:
        # beside other traffic the share moves with requests the run does not know: its level is
        # theirs as much as the cancelled one's
        return went + (f", with {cancel.evidence.foreign_requests} request(s) of other traffic taking and "
                       "giving back space too: the cancelled request left the scheduler (below), and what the "
                       "share shows is everyone's.")
    if cancel.verdict == "released":
        return went + ": the cancelled request's space went back to the pool, ready for the next request."
    return went + ": this run does not show the cancelled request's space going back (below)."


def _run_memory_story(engine: str, kind: str, held: list, kv: list, verdicts: list[CancelVerdict]) -> list[str]:
    """memory_story of the whole run: the reserved memory's range, the KV share's peak, the verdicts' counts."""
    sentences = []
    counts = verdict_counts(verdicts)
    if held:
        lo = min(float(np.nanmin(tr.v)) for tr in held if len(tr.v))
        hi = max(float(np.nanmax(tr.v)) for tr in held if len(tr.v))
        sentences.append(
            f"Over the whole run {WHAT[kind]} stayed between {_gib(lo)} and {_gib(hi)}: " + (
                "vLLM reserves its KV-cache pool at start-up and keeps it, so this number does not fall when a "
                "request is cancelled." if engine == VLLM else FLAT[engine]))
    if kv:
        peak = max(float(np.nanmax(k.v)) for k in kv if len(k.v))
        sentences.append(f"What does move is the share of that pool holding requests (KV-cache usage, peak {_percent(peak)}), "
                         "and it fell after the cancels that were released.")
    if verdicts:
        parts = [f"{n} {name.replace('_', ' ')}" for name, n in counts.items() if n]
        sentences.append(f"Of {len(verdicts)} cancels: {', '.join(parts)}.")
    else:
        sentences.append("This run holds no cancels: record some with `cancelwatch record --scenario default`.")
    return sentences


def _verdict_sentence(v: CancelVerdict) -> str:
    """What became of the cancelled request, and, where taps stood in the path, its way through them."""
    sentence = _what_became(v)
    return f"{sentence} Hop by hop: {v.evidence.path}." if v.evidence.path else sentence


def _what_became(v: CancelVerdict) -> str:
    tp, ev = v.timepoints, v.evidence
    who = f"The cancelled request ({v.scenario}, {v.request_id})"
    if v.verdict == "released":
        probe = tp.get("reusable")
        tail = (f", and a new request got in {1000 * (probe - tp['user_stop']):.0f} ms after the Stop"
                if probe is not None else ", but no new request was seen getting in")
        source = v.source_of("engine_abort")
        if ev.model is not None:  # Triton: the model's own log, or the core's CANCELED count
            since = (f"the model logged that it saw the cancel ({1000 * (tp['engine_abort'] - tp['user_stop']):.0f} ms "
                     "after the Stop)" if source == "engine_log" else "the server's core dropped it from its queue "
                     "(its CANCELED count rose)")
            return f"{who} left the server {ev.release_ms or 0:.0f} ms after {since}{tail}."
        if source == "engine_log":
            since = f"the engine logged its abort ({1000 * (tp['engine_abort'] - tp['user_stop']):.0f} ms after the Stop)"
        elif source == "relay":
            since = "the app's abort call returned (measured inside the app)"
        else:
            since = ("the client closed its connection (no engine log was read, so the engine's own abort "
                     "is not seen)")
        return f"{who} left the engine {ev.release_ms or 0:.0f} ms after {since}{tail}."
    if v.verdict == "leaked":
        if ev.model is not None and v.rule == "model_kept_buffer":
            return (f"{who} was NOT released: {ev.why}. The model stopped working on it, but kept the memory it "
                    "held.")
        if ev.model is not None:  # Triton: the why names the cause (HTTP, a deaf backend, a lost cancel)
            return f"{who} was NOT released: {ev.why}. The server worked for nobody."
        if v.rule in LOST_CANCEL:
            return (f"{who} was NOT released: {ev.why}. The engine generated for nobody; the cancel was lost on "
                    "the way (a proxy or app that does not pass it on).")
        if v.rule == "app_lost_cancel":
            if (ev.app_answer or "").startswith(("no answer", "HTTP ")):
                return (f"{who} was NOT released: {ev.why}. The cancel call to the app failed, and the engine "
                        "generated for nobody until the request's end.")
            return (f"{who} was NOT released: {ev.why}. The Stop reached the app, and the app said so, but the "
                    "engine was never made to let the request go: the app lost the cancel.")
        if v.rule == "abort_after_grace":
            return (f"{who} was NOT released in time: {ev.why}. The cancel was not lost but late: something on "
                    "the way held it (a proxy or app slow to pass it on), or the engine was slow to act on it.")
        if v.rule == "resubmitted_after_stop":
            return (f"{who} was NOT released: {ev.why}. The cancel itself reached the engine; the copy sent after "
                    "it is what kept the engine busy.")
        if v.rule == "abort_logged_still_generating":
            return (f"{who} was NOT released: the engine logged the abort, yet still counted the request "
                    f"{ev.grace_s:g} s later and kept generating. The cancel reached the engine; the engine did "
                    "not let the request go.")
        return (f"{who} was NOT released: the engine still counted it {ev.grace_s:g} s after the cancel and "
                "kept generating for nobody. Without the engine's log this run cannot tell whether the cancel was "
                "lost on the way or reached an engine that kept the request: record with --engine-log.")
    if v.verdict == "stale_gauge":
        return (f"{who} looks held only because the engine's gauges had not refreshed: no tokens were generated, "
                "so the numbers were stale rather than the request still running.")
    return f"{who} could not be judged from this run ({ev.why or 'not enough evidence'})."


def pick_story_cancel(verdicts: list[CancelVerdict]) -> CancelVerdict | None:
    """The cancel to tell the story with: the first one not released, else the released one whose
    KV usage fell the most (the clearest picture of reserved memory staying flat while usage falls)."""
    bad = [v for v in verdicts if v.verdict != "released"]
    if bad or not verdicts:
        return (bad or [None])[0]

    def drop(v: CancelVerdict) -> float:
        before, after = v.evidence.kv_before, v.evidence.kv_after
        return (before - after) if before is not None and after is not None and not math.isnan(before) else -1.0

    return max(verdicts, key=drop)
