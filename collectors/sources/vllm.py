"""vLLM's Prometheus `/metrics` as a source.

Fetching and parsing are apart: `parse_vllm_metrics` is pure and takes the body text.
All Prometheus text goes through prometheus_client's parser.
"""

from __future__ import annotations

import re

from cancelwatch.collectors.sources.base import ParseError, SourceError
from cancelwatch.collectors.sources.prom_text import LineMemo, PromTextSource, json_version, sample_name
from cancelwatch.runstore.records import Sample

# Server sample name -> (our name, rank). When one body holds several server names for the same
# series (vLLM 0.10 sends both KV names), the lowest rank wins. A vLLM rename breaks this dict,
# not a chart. Names not listed keep their `vllm:` name.
ALIASES: dict[str, tuple[str, int]] = {
    "vllm:kv_cache_usage_perc": ("kv_cache_usage_ratio", 0),
    "vllm:gpu_cache_usage_perc": ("kv_cache_usage_ratio", 1),  # 0.10 shown, 0.11 hidden, 0.12 gone
    "vllm:num_requests_running": ("requests_running", 0),
    "vllm:num_requests_waiting": ("requests_waiting", 0),
    "vllm:prefix_cache_queries_total": ("prefix_cache_queries_tokens_total", 0),
    "vllm:gpu_prefix_cache_queries_total": ("prefix_cache_queries_tokens_total", 1),  # gone in 0.12
    "vllm:prefix_cache_hits_total": ("prefix_cache_hits_tokens_total", 0),
    "vllm:gpu_prefix_cache_hits_total": ("prefix_cache_hits_tokens_total", 1),  # gone in 0.12
    "vllm:num_preemptions_total": ("preemptions_total", 0),
    "vllm:prompt_tokens_total": ("prompt_tokens_total", 0),
    "vllm:generation_tokens_total": ("generation_tokens_total", 0),
    "vllm:request_success_total": ("requests_finished_total", 0),
}

CACHE_CONFIG_METRIC = "vllm:cache_config_info"


SOURCE_NAME = "vllm"
# the engine family of a target this source reads: each of a run's targets records its family, which analysis
# judges it by
FAMILY = "vllm"
SCRAPE_JOB = "vllm"  # the Prometheus job vLLM replicas are usually scraped under: --job's default


# One C-speed pass picks the vLLM sample lines out of a ~50 KB body; HELP/TYPE lines are not needed
# because series are named by their sample names.
_VLLM_LINE = re.compile(r"^vllm:[^\n]*", re.MULTILINE)


def _vllm_lines(text: str) -> list[str]:
    # Histogram buckets are most of the body and nothing here reads them at 20 Hz (`_sum`/`_count`
    # stay); `_created` timestamps are not measurements.
    return [
        line for line in _VLLM_LINE.findall(text)
        if not sample_name(line).endswith(("_bucket", "_created"))
    ]


def parse_vllm_metrics(
    text: str, wall_ns: int, mono_ns: int, source: str = SOURCE_NAME, memo: LineMemo | None = None
) -> list[Sample]:
    """Every `vllm:` series of one /metrics body as Samples, aliased names folded into ours.

    Raises ParseError for a body that is not Prometheus text, is cut short, or holds no vLLM series.
    `memo` only saves work; the result is the same with or without it.
    """
    if not text.endswith("\n"):
        raise ParseError("truncated /metrics body (no final newline)")
    lines = _vllm_lines(text)
    parsed = (memo or LineMemo()).parse(lines)
    chosen: dict[tuple, tuple[int, Sample]] = {}
    for name, labels, value in parsed:
        metric, rank = ALIASES.get(name, (name, 0))
        key = (metric, labels)
        prior = chosen.get(key)
        if prior is not None and prior[0] <= rank:
            continue
        chosen[key] = (rank, Sample(source, metric, value, labels, wall_ns, mono_ns))
    if not chosen:
        raise ParseError("no vllm: series in the /metrics body: is this a vLLM server?")
    return [sample for _, sample in chosen.values()]


def cache_config(samples: list[Sample]) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (num_gpu_blocks, block_size, ...), or {}."""
    for s in samples:
        if s.metric == CACHE_CONFIG_METRIC:
            return {k: v for k, v in s.labels if k not in ("engine", "model_name")}
    return {}


def model_names(samples: list[Sample]) -> list[str]:
    return sorted({v for s in samples for k, v in s.labels if k == "model_name"})


def server_version(base_url: str, timeout_s: float = 2.0) -> str | None:
    """vLLM's own version, from its `GET /version`; None when the server does not say."""
    return json_version(base_url.rstrip("/") + "/version", timeout_s)


class VllmMetricsSource(PromTextSource):
    """One vLLM server's /metrics (see prom_text.MetricsEndpoint for how it is read)."""

    name = SOURCE_NAME

    def parse(self, text: str, wall_ns: int, mono_ns: int, memo: LineMemo | None = None) -> list[Sample]:
        return parse_vllm_metrics(text, wall_ns, mono_ns, memo=memo)

    def lines(self, text: str) -> list[str]:
        return _vllm_lines(text)

    def unreadable(self, exc: SourceError) -> str:
        return f"cannot read {self.metrics_url} ({exc}); start the engine (cancelwatch engine up) or fix --target"

    def fast_names(self, names: list[str]) -> list[str]:
        """Between full bodies, only the series the analysis reads (ALIASES: scheduler, KV, prefix cache,
        preemptions, token and request counters). Measured on the embedded engine (bench/observer.py),
        the API server spends 2.1 ms of CPU on a scrape of all 55 kept names (histograms' _sum/_count
        among them) and 0.5 ms on these 9: at 20 Hz, 4 % of its core against 1 %, taken from serving
        tokens. The full body every `full_every_s` still records every series."""
        fast = [n for n in names if n in ALIASES]
        return fast or names
