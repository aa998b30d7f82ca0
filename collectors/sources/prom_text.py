"""Prometheus text over HTTP, for any server that exposes it (vLLM, Triton, an exporter).

`MetricsEndpoint` fetches one `/metrics` over kept-alive connections and, once told which sample
names matter, asks for only those (`?name[]=...`); `LineMemo` parses sample lines through
prometheus_client's parser, once per series. Nothing here knows a vLLM name: the vLLM source
(and later others) choose lines and names on top.
"""

from __future__ import annotations

import http.client
import math
import re
import threading
import time
from urllib.parse import urlencode, urlparse

from prometheus_client.parser import text_string_to_metric_families

from cancelwatch.collectors.sources.credentials import split_userinfo
from cancelwatch.collectors.sources.base import ParseError, Source, SourceError
from cancelwatch.runstore.records import Labels, Sample, freeze_labels

# answers of a server that has no filterable route: full bodies from then on
FILTER_UNSUPPORTED = (301, 302, 307, 308, 400, 404)


class HTTPStatusError(SourceError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def sample_name(line: str) -> str:
    """The sample name of a sample line (`name{labels} value` or `name value`)."""
    return line.split("{", 1)[0].split(" ", 1)[0]


def _split_value(line: str) -> tuple[str, str] | None:
    """(series part, value token) of a sample line `series value` (one space, no timestamp); None for
    anything else. Split at spaces only, as prometheus_client does: str.split() also split at a \\v or
    U+2028, so a line the parser refuses ('name\\v1') was read through the memo (found by tests/test_fuzz.py)."""
    series, sep, value = line.rpartition(" ")
    if not sep or not value:
        return None
    brace = line.rfind("}")
    if brace >= 0:
        return (series, value) if len(series) == brace + 1 else None
    return (series, value) if series.split() == [series] else None


# The memo's fast path reads a value only when it is written the plain way (ASCII digits, Inf, NaN); any
# other spelling goes through the parser, so both ways give one answer (float() alone took '1_000', which
# prometheus_client refuses: found by tests/test_fuzz.py).
_PLAIN_VALUE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?Inf|NaN")


def _as_float(value: int | float) -> float:
    """prometheus_client gives an int for integer text; one of 400 digits is too large for a float (an
    OverflowError, found by tests/test_fuzz.py): +-inf then, as float('1e999') and the memo's path give."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def one_line(text: str, limit: int = 200) -> str:
    """Text for a one-line error: prometheus_client quotes the offending line, which may hold a \\r, \\v or
    U+2028 (found by tests/test_fuzz.py); cut short, a line can be the whole body."""
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else text[:limit] + "..."


def parse_lines(lines: list[str]) -> list[tuple[str, Labels, float]]:
    """(sample name, labels, value) of each sample line, through prometheus_client's parser.
    Raises ParseError unless every line gives exactly one sample."""
    try:
        samples = [s for fam in text_string_to_metric_families("\n".join(lines) + "\n") for s in fam.samples]
    except (ValueError, TypeError, IndexError) as exc:
        raise ParseError(f"unparseable /metrics body: {one_line(str(exc))}") from exc
    if len(samples) != len(lines):
        raise ParseError(f"unparseable /metrics body: {len(lines)} sample lines gave {len(samples)} samples")
    return [(s.name, freeze_labels(s.labels), _as_float(s.value)) for s in samples]


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
            known = self._series.get(split[0]) if split and _PLAIN_VALUE.fullmatch(split[1]) else None
            if known is None:
                fresh.append(len(out))
                out.append(None)
                continue
            try:
                out.append((known[0], known[1], float(split[1])))
            except ValueError as exc:
                raise ParseError(f"unparseable /metrics body: bad value in {line[:80]!r}") from exc
        if fresh:
            parsed = parse_lines([lines[i] for i in fresh])
            if len(self._series) + len(fresh) > self.max_series:
                self._series.clear()
            for i, item in zip(fresh, parsed):
                out[i] = item
                split = _split_value(lines[i])
                if split is not None:
                    self._series[split[0]] = (item[0], item[1])
        return out  # type: ignore[return-value]


class MetricsEndpoint:
    """One server's `/metrics`, read over kept-alive connections, one per reader thread.

    http.client rather than httpx here: measured on this 2-core machine, httpx spends about 0.85 ms
    more CPU per request, which at 20 Hz alone is 1.7% of a core of the sampler's 5% budget.

    prometheus_client's exposition app (vLLM mounts it at /metrics/) honours `name[]` filters: once
    `keep_only(names)` is told the sample names that matter, reads ask for just those, which cuts a
    ~50 KB body (mostly histogram buckets) to a few KB, for the server as much as for us. A full body
    every `full_every_s` picks up new series; a server without the route gets full bodies.
    """

    def __init__(self, base_url: str, timeout_s: float = 1.0, full_every_s: float = 10.0):
        # user:password in the URL: sent as Basic credentials, kept out of url (messages, gaps, the run)
        base_url, self._auth = split_userinfo(base_url)
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/metrics"
        self.timeout_s = timeout_s
        self.full_every_s = full_every_s
        parsed = urlparse(self.base_url)
        self._https = parsed.scheme == "https"
        self._host, self._port = parsed.hostname, parsed.port
        self._path = (parsed.path or "") + "/metrics"
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
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
        """One GET of `path` (default: the full /metrics). SourceError on a network failure,
        HTTPStatusError on any answer but 200."""
        path = path or self._path
        conn = self._connection()
        reused = conn.sock is not None
        try:
            resp, body = self._get(conn, path)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if not reused:
                raise SourceError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
            try:  # the server may have closed an idle kept-alive connection: one fresh try
                resp, body = self._get(conn, path)
            except (OSError, http.client.HTTPException) as exc2:
                conn.close()
                raise SourceError(f"{self.url}: {type(exc2).__name__}: {exc2}") from exc2
        if resp.status != 200:
            raise HTTPStatusError(f"{self.url} answered HTTP {resp.status}", resp.status)
        return body.decode("utf-8", errors="replace")

    def _get(self, conn: http.client.HTTPConnection, path: str) -> tuple[http.client.HTTPResponse, bytes]:
        headers = {"Accept-Encoding": "identity"}
        if self._auth:
            headers["Authorization"] = self._auth
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp, resp.read()

    def read(self) -> tuple[str, float | None]:
        """(body, when) of one scrape: the filtered body while the names are fresh (`when` None), else
        the full body and the monotonic time it was asked for, to hand to `keep_only` once it parsed."""
        now = time.monotonic()
        if self._filter_ok and self._filtered_path is not None and now - self._full_at < self.full_every_s:
            try:
                return self.fetch(self._filtered_path), None
            except HTTPStatusError as exc:
                if exc.status not in FILTER_UNSUPPORTED:
                    raise
                self._filter_ok = False
        return self.fetch(), now

    def keep_only(self, names: list[str], full_read_at: float) -> None:
        """Ask for just these sample names until `full_every_s` after the full read they came from.
        Call it only with names of a body that parsed: a garbled one would narrow every later scrape."""
        self._filtered_path = self._path + "/?" + urlencode([("name[]", n) for n in sorted(names)])
        self._full_at = full_read_at

    def close(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._local = threading.local()


class PromTextSource(Source):
    """One server's Prometheus text as a source: read through `MetricsEndpoint` (kept-alive, `name[]`
    filtered once the names are known), parsed by the subclass's `parse` from the lines its `lines`
    keeps; `unreadable` says how to fix an endpoint that cannot be read."""

    max_in_flight = 4  # a busy server may answer late; later ticks still start on time

    def __init__(self, url: str, target: str, timeout_s: float = 1.0, critical: bool = True):
        self.critical = critical  # losing it ends the run (target_lost)
        self.target = target
        self.endpoint = MetricsEndpoint(url, timeout_s)
        self.base_url, self.metrics_url = self.endpoint.base_url, self.endpoint.url
        self._memo = LineMemo()

    def parse(self, text: str, wall_ns: int, mono_ns: int, memo: LineMemo | None = None) -> list[Sample]:
        raise NotImplementedError

    def lines(self, text: str) -> list[str]:
        raise NotImplementedError

    def unreadable(self, exc: SourceError) -> str:
        raise NotImplementedError

    def fast_names(self, names: list[str]) -> list[str]:
        """Of the sample names a full body held, those asked for between full bodies (default: all)."""
        return names

    def check(self) -> str | None:
        try:
            self.parse(self.endpoint.fetch(), 0, 0)
        except SourceError as exc:
            return self.unreadable(exc)
        return None

    def sample(self, wall_ns: int, mono_ns: int) -> list[Sample]:
        text, full_read_at = self.endpoint.read()
        samples = self.parse(text, wall_ns, mono_ns, memo=self._memo)
        if full_read_at is not None:
            self.endpoint.keep_only(self.fast_names(sorted({sample_name(line) for line in self.lines(text)})),
                                    full_read_at)
        return samples

    def close(self) -> None:
        self.endpoint.close()


def json_version(url: str, timeout_s: float = 2.0) -> str | None:
    """The `version` field of a server's JSON answer at `url` (vLLM's /version, Triton's /v2); None
    when it does not say (a proxy, an older build): a run records unknown rather than a guess."""
    import httpx

    try:
        resp = httpx.get(url, timeout=timeout_s)
        version = resp.json().get("version") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(version) if version else None
