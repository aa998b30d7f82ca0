"""vLLM's Prometheus `/metrics` as a source.

Fetching and parsing are apart: `parse_vllm_metrics` is pure and takes the body text.
All Prometheus text goes through prometheus_client's parser.
"""

from __future__ import annotations

import re

from collectors.sources.base import ParseError, Source, SourceError
from collectors.sources.prom_text import LineMemo, MetricsEndpoint, sample_name
from runstore.records import Sample

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
    """vLLM's own version, from its `GET /version`; None when the server does not say (a proxy, an
    older build): the run then records that it is unknown rather than a guess."""
    import httpx

    try:
        resp = httpx.get(base_url.rstrip("/") + "/version", timeout=timeout_s)
        version = resp.json().get("version") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(version) if version else None


class VllmMetricsSource(Source):
    """One vLLM server's /metrics (see prom_text.MetricsEndpoint for how it is read)."""

    name = SOURCE_NAME
    max_in_flight = 4  # a busy API server may answer late; later ticks still start on time

    def __init__(self, url: str, target: str, timeout_s: float = 1.0, critical: bool = True):
        self.critical = critical  # losing it ends the run (target_lost)
        self.target = target
        self.endpoint = MetricsEndpoint(url, timeout_s)
        self.base_url, self.metrics_url = self.endpoint.base_url, self.endpoint.url
        self._memo = LineMemo()

    def check(self) -> str | None:
        try:
            parse_vllm_metrics(self.endpoint.fetch(), 0, 0)
        except SourceError as exc:
            return f"cannot read {self.metrics_url} ({exc}); start the engine (cancelwatch engine up) or fix --target"
        return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        text, full_read_at = self.endpoint.read()
        samples = parse_vllm_metrics(text, wall_ns, mono_ns, memo=self._memo)
        if full_read_at is not None:
            self.endpoint.keep_only(sorted({sample_name(line) for line in _vllm_lines(text)}), full_read_at)
        return samples

    def close(self) -> None:
        self.endpoint.close()
