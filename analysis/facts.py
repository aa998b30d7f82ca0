"""What a run is: engine, model, KV pool, memory source and how well it was sampled."""

from __future__ import annotations

import math
from datetime import datetime, timezone

from cancelwatch.analysis.summary import sampling_stats
from cancelwatch.analysis.verdicts import TRITON, VLLM, family_of, log_clocks
from cancelwatch.runstore.reader import Run
from cancelwatch.runstore.records import DriveSettings

# the series the verdicts read; a window judged on its own (the live judge's, a long run's) reads only these
VERDICT_METRICS = (
    "requests_running", "requests_waiting", "kv_cache_usage_ratio", "generation_tokens_total",
    "prefix_cache_hits_tokens_total", "preemptions_total",
    "requests_finished_total",  # the engine's own ends by reason: what a release without the request log rests on
    "client_chunks_total",  # what reached the run's own clients: the tokens made for nobody are read against it
    # Triton: what its verdicts rest on, and the models' own memory
    "model_active_requests", "model_steps_total", "triton_pending_requests", "triton_request_failure_total",
    "triton_request_success_total", "model_buffer_bytes",
)
# the series the dashboard, the report and the notebooks read; load_run(metrics=...) takes only these: the verdicts',
# the prefix cache's hit rate and the memory's (what nvidia-smi shows beside the engine's own figures)
VIEW_METRICS = VERDICT_METRICS + (
    "prefix_cache_queries_tokens_total",
    "engine_rss_bytes", "gpu_memory_used_bytes", "gpu_memory_reserved_bytes", "gpu_memory_total_bytes",
)


def _number(value) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def scheduler_targets(run: Run) -> list[str]:
    """Labels of the targets whose scheduler was sampled, in the run's order."""
    return [t["label"] for t in run.info.get("targets", [])]


def kv_pool(run: Run, target: str | None = None) -> dict:
    """The KV pool of one target from vllm:cache_config_info: blocks, block size, tokens and bytes.

    Bytes come from `kv_cache_memory_bytes` where the engine reports it, else from the embedded
    engine's bytes per token; None when neither is known.
    """
    labels = scheduler_targets(run)
    target = target or (labels[0] if labels else None)
    cache = run.info.get("cache", {}).get(target, {}) if target else {}
    engine = run.info.get("engine", {}).get("targets", {}).get(target, {}) if target else {}
    blocks = _number(cache.get("num_gpu_blocks")) or _number(engine.get("shape", {}).get("num_gpu_blocks"))
    block_size = _number(cache.get("block_size")) or _number(engine.get("shape", {}).get("block_size"))
    tokens = _number(cache.get("kv_cache_size_tokens"))
    if tokens is None and blocks and block_size:
        tokens = blocks * block_size
    nbytes = _number(cache.get("kv_cache_memory_bytes"))
    per_token = _number(engine.get("kv_bytes_per_token"))
    if nbytes is None and tokens and per_token:
        nbytes = tokens * per_token
    return {
        "target": target,
        "blocks": int(blocks) if blocks else None,
        "block_size": int(block_size) if block_size else None,
        "tokens": int(tokens) if tokens else None,
        "bytes": int(nbytes) if nbytes else None,
        "prefix_caching": cache.get("enable_prefix_caching"),
    }


def memory_source(run: Run) -> str:
    """'nvml' when the run has GPU memory readings, 'process' for the engine's RSS, else 'none'."""
    if run.has_metric("gpu_memory_used_bytes"):
        return "nvml"
    if run.has_metric("engine_rss_bytes"):
        return "process"
    return "none"


def _engine_label(family: str, engine: dict, engines: dict) -> str:
    embedded = any(e.get("embedded") for e in engines.values())
    if engine.get("imported"):
        imp = engine["imported"]
        return f"imported history from Prometheus {imp.get('url')} (step {imp.get('step_s'):g} s)"
    if family == TRITON:
        return "embedded Triton (tritonserver of the nvidia-pytriton wheel, CPU)" if embedded else "external Triton"
    return "embedded vLLM (CPU build)" if embedded else "external"


def run_facts(run: Run) -> dict:
    info = run.info
    started = datetime.fromtimestamp(info["started_wall_ns"] / 1e9, tz=timezone.utc)
    ended = info.get("ended_wall_ns")
    engines = info.get("engine", {}).get("targets", {})
    settings = info.get("settings", {})
    stats = sampling_stats(run)
    model = next((e.get("model") for e in engines.values() if e.get("model")), None)
    served = next((c.get("model_names") for c in info.get("cache", {}).values() if c.get("model_names")), None)
    family = family_of(run)
    return {
        "run_id": run.id,
        "name": info.get("name"),
        "status": info["status"],
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"),
        "duration_s": (ended - info["started_wall_ns"]) / 1e9 if ended else None,
        "family": family,
        "targets": [{"label": t["label"], "url": t.get("url"), "family": t.get("family")} for t in info.get("targets", [])],
        "driven_target": DriveSettings.of_run(settings).driven_target,
        "engine": _engine_label(family, info.get("engine") or {}, engines),
        "version": ", ".join(dict.fromkeys(str(e["version"]) for e in engines.values() if e.get("version"))) or None,
        "model": model,
        "served_model": ", ".join(served) if served else None,
        "kv_pools": [kv_pool(run, t) for t in scheduler_targets(run)],
        "hz": settings.get("hz"),
        "burst_hz": settings.get("burst_hz"),
        "burst_window_s": settings.get("burst_window_s"),
        "nvml": info.get("engine", {}).get("nvml"),
        "memory_source": memory_source(run),
        "sampling": stats.to_dict("records") if not stats.empty else [],
        "gap_ticks": int(stats["gap_ticks"].sum()) if not stats.empty else 0,
        # where the engine log's lines sit on the run's clock (the verdicts move them by offset_s)
        "engine_log_clock": [c.as_json() for c in log_clocks(run).values()] if family == VLLM else [],
    }
