"""vLLM's Prometheus `/metrics` as a source.

Fetching and parsing are apart: `parse_vllm_metrics` is pure and takes the body text.
All Prometheus text goes through prometheus_client's parser.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from collectors.samples import Labels, Sample, freeze_labels
from collectors.source import ParseError, SourceError

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


def _keep_line(line: str) -> bool:
    # Only vLLM sample lines are kept. Histogram buckets are most of the body and nothing here reads
    # them at 20 Hz (`_sum`/`_count` stay); `_created` timestamps are not measurements; HELP/TYPE
    # lines are not needed because series are named by their sample names.
    if not line.startswith("vllm:"):
        return False
    name = line.split("{", 1)[0].split(" ", 1)[0]
    return not name.endswith(("_bucket", "_created"))


class LineMemo:
    """Parsed (name, labels, value) per exact sample line, so unchanged lines are not parsed again.

    prometheus_client's parser costs about 25 us per line; at 20 Hz a whole vLLM body would cost
    several percent of a core, while between two scrapes only the lines whose values moved differ.
    """

    def __init__(self, max_lines: int = 20000):
        self.max_lines = max_lines
        self._parsed: dict[str, tuple[str, Labels, float]] = {}

    def parse(self, lines: list[str]) -> list[tuple[str, Labels, float]]:
        fresh = [line for line in lines if line not in self._parsed]
        if fresh:
            if len(self._parsed) + len(fresh) > self.max_lines:
                self._parsed.clear()
            for line, parsed in zip(fresh, _parse_fresh(fresh)):
                self._parsed[line] = parsed
        return [self._parsed[line] for line in lines]


def _parse_fresh(lines: list[str]) -> list[tuple[str, Labels, float]]:
    try:
        samples = [s for fam in text_string_to_metric_families("\n".join(lines) + "\n") for s in fam.samples]
    except (ValueError, TypeError, IndexError) as exc:
        raise ParseError(f"unparseable /metrics body: {exc}") from exc
    if len(samples) != len(lines):
        raise ParseError(f"unparseable /metrics body: {len(lines)} sample lines gave {len(samples)} samples")
    return [(s.name, freeze_labels(s.labels), float(s.value)) for s in samples]


def parse_vllm_metrics(
    text: str, wall_ns: int, mono_ns: int, source: str = SOURCE_NAME, memo: LineMemo | None = None
) -> list[Sample]:
    """Every `vllm:` series of one /metrics body as Samples, aliased names folded into ours.

    Raises ParseError for a body that is not Prometheus text, is cut short, or holds no vLLM series.
    `memo` only saves work; the result is the same with or without it.
    """
    if not text.endswith("\n"):
        raise ParseError("truncated /metrics body (no final newline)")
    lines = [line for line in text.splitlines() if _keep_line(line)]
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


class VllmMetricsSource:
    """Scrapes one vLLM server's /metrics with a kept-alive HTTP connection."""

    name = SOURCE_NAME

    def __init__(self, url: str, target: str, timeout_s: float = 1.0, client: httpx.Client | None = None):
        self.base_url = url.rstrip("/")
        self.metrics_url = self.base_url + "/metrics"
        self.target = target
        self._client = client or httpx.Client(timeout=timeout_s)
        self._memo = LineMemo()

    def fetch(self) -> str:
        try:
            resp = self._client.get(self.metrics_url)
        except httpx.HTTPError as exc:
            raise SourceError(f"{self.metrics_url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise SourceError(f"{self.metrics_url} answered HTTP {resp.status_code}")
        return resp.text

    def check(self) -> str | None:
        try:
            text = self.fetch()
            parse_vllm_metrics(text, 0, 0)
        except SourceError as exc:
            return f"cannot read {self.metrics_url} ({exc}); start the engine (cancelwatch engine up) or fix --target"
        return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        return parse_vllm_metrics(self.fetch(), wall_ns, mono_ns, memo=self._memo)

    def close(self) -> None:
        self._client.close()
