"""vLLM's Prometheus `/metrics` as a source.

Fetching and parsing are apart: `parse_vllm_metrics` is pure and takes the body text.
All Prometheus text goes through prometheus_client's parser.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from urllib.parse import urlencode, urlparse

from prometheus_client.parser import text_string_to_metric_families

from collectors.sources.base import ParseError, SourceError
from runstore.records import Labels, Sample, freeze_labels

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


class HTTPStatusError(SourceError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
SOURCE_NAME = "vllm"


# One C-speed pass picks the vLLM sample lines out of a ~50 KB body; HELP/TYPE lines are not needed
# because series are named by their sample names.
_VLLM_LINE = re.compile(r"^vllm:[^\n]*", re.MULTILINE)


def _vllm_lines(text: str) -> list[str]:
    # Histogram buckets are most of the body and nothing here reads them at 20 Hz (`_sum`/`_count`
    # stay); `_created` timestamps are not measurements.
    return [
        line for line in _VLLM_LINE.findall(text)
        if not line.split("{", 1)[0].split(" ", 1)[0].endswith(("_bucket", "_created"))
    ]


def _split_value(line: str) -> tuple[str, str] | None:
    """(series part, value token) of a sample line without a timestamp; None for anything else."""
    brace = line.rfind("}")
    if brace >= 0:
        series, rest = line[: brace + 1], line[brace + 1 :].split()
        return (series, rest[0]) if len(rest) == 1 else None
    parts = line.split()
    return (parts[0], parts[1]) if len(parts) == 2 else None


class LineMemo:
    """Parsed (name, labels) per series, so only values are read on later scrapes.

    prometheus_client's parser costs about 25 us per line; at 20 Hz, re-parsing the ~70 vLLM lines
    would cost several percent of a core, while between two scrapes only values change. A series
    seen for the first time (and any line with a timestamp) goes through the parser whole.
    Safe to share between reader threads: a lookup that races a clear() falls back to a fresh parse.
    """

    def __init__(self, max_series: int = 20000):
        self.max_series = max_series
        self._series: dict[str, tuple[str, Labels]] = {}

    def parse(self, lines: list[str]) -> list[tuple[str, Labels, float]]:
        out: list[tuple[str, Labels, float] | None] = []
        fresh: list[int] = []
        for line in lines:
            split = _split_value(line)
            known = self._series.get(split[0]) if split else None
            if known is None:
                fresh.append(len(out))
                out.append(None)
                continue
            try:
                out.append((known[0], known[1], float(split[1])))
            except ValueError as exc:
                raise ParseError(f"unparseable /metrics body: bad value in {line[:80]!r}") from exc
        if fresh:
            parsed = _parse_fresh([lines[i] for i in fresh])
            if len(self._series) + len(fresh) > self.max_series:
                self._series.clear()
            for i, item in zip(fresh, parsed):
                out[i] = item
                split = _split_value(lines[i])
                if split is not None:
                    self._series[split[0]] = (item[0], item[1])
        return out  # type: ignore[return-value]


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


class VllmMetricsSource:
    """Scrapes one vLLM server's /metrics over kept-alive connections, one per reader thread.

    http.client rather than httpx here: measured on this 2-core machine, httpx spends about 0.85 ms
    more CPU per request, which at 20 Hz alone is 1.7% of a core of the sampler's 5% budget.
    """

    name = SOURCE_NAME
    max_in_flight = 4  # a busy API server may answer late; later ticks still start on time

    def __init__(self, url: str, target: str, timeout_s: float = 1.0, critical: bool = True):
        self.critical = critical  # losing it ends the run (target_lost)
        self.base_url = url.rstrip("/")
        self.metrics_url = self.base_url + "/metrics"
        self.target = target
        self.timeout_s = timeout_s
        parsed = urlparse(self.base_url)
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port
        self._path = (parsed.path or "") + "/metrics"
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._memo = LineMemo()
        # prometheus_client's exposition app (vLLM mounts it at /metrics/) honours `name[]` filters:
        # asking for the sample names we keep cuts a ~50 KB body (mostly histogram buckets) to a few
        # KB, for the server as much as for us. A full body every `full_every_s` picks up new series.
        self.full_every_s = 10.0
        self._filtered_path: str | None = None
        self._filter_ok = True
        self._full_at = -1e9

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout_s)
            self._local.conn = conn
            self._all.append(conn)
        return conn

    def fetch(self, path: str | None = None) -> str:
        path = path or self._path
        conn = self._connection()
        reused = conn.sock is not None
        try:
            resp, body = self._get(conn, path)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if not reused:
                raise SourceError(f"{self.metrics_url}: {type(exc).__name__}: {exc}") from exc
            try:  # the server may have closed an idle kept-alive connection: one fresh try
                resp, body = self._get(conn, path)
            except (OSError, http.client.HTTPException) as exc2:
                conn.close()
                raise SourceError(f"{self.metrics_url}: {type(exc2).__name__}: {exc2}") from exc2
        if resp.status != 200:
            raise HTTPStatusError(f"{self.metrics_url} answered HTTP {resp.status}", resp.status)
        return body.decode("utf-8", errors="replace")

    def _get(self, conn: http.client.HTTPConnection, path: str) -> tuple[http.client.HTTPResponse, bytes]:
        conn.request("GET", path, headers={"Accept-Encoding": "identity"})
        resp = conn.getresponse()
        return resp, resp.read()

    def check(self) -> str | None:
        try:
            parse_vllm_metrics(self.fetch(), 0, 0)
        except SourceError as exc:
            return f"cannot read {self.metrics_url} ({exc}); start the engine (cancelwatch engine up) or fix --target"
        return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        now = time.monotonic()
        filtered = self._filter_ok and self._filtered_path is not None and now - self._full_at < self.full_every_s
        if filtered:
            try:
                text = self.fetch(self._filtered_path)
            except HTTPStatusError as exc:
                if exc.status in (301, 302, 307, 308, 400, 404):
                    self._filter_ok = False  # a server without the filterable route: full bodies from now on
                    return self.sample(wall_ns, mono_ns)
                raise
            return parse_vllm_metrics(text, wall_ns, mono_ns, memo=self._memo)
        text = self.fetch()
        samples = parse_vllm_metrics(text, wall_ns, mono_ns, memo=self._memo)
        # only a body that parsed may choose the names: a garbled one would narrow every later scrape
        names = sorted({line.split("{", 1)[0].split(" ", 1)[0] for line in _vllm_lines(text)})
        self._filtered_path = self._path + "/?" + urlencode([("name[]", n) for n in names])
        self._full_at = now
        return samples

    def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._local = threading.local()
