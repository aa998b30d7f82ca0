"""A Prometheus server's HTTP API as a source of history: range queries (prometheus-api-client), fetched in
chunks that stay under Prometheus's 11,000 points per series and query, and the times and steps a user
types. Nothing here knows a vLLM name; the importer (recording/prometheus_import) chooses the queries.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

from cancelwatch.collectors.sources.base import SourceError
from cancelwatch.collectors.sources.credentials import strip_userinfo

MAX_POINTS = 10_000  # per series and query: Prometheus refuses more than 11,000
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


class PrometheusError(SourceError):
    """Prometheus could not answer (unreachable, a bad query); the message names the fix."""


def parse_duration(text: str) -> float:
    """Seconds of a Prometheus-style duration (`500ms`, `15s`, `1m`, `2h`, `7d`); ValueError names the form."""
    m = _DURATION.match(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration: write it like 15s, 1m, 2h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_time(text: str, now: float) -> float:
    """Epoch seconds of `now`, `now-2h`, an ISO 8601 time (UTC unless it says otherwise) or epoch seconds."""
    t = text.strip()
    if t == "now":
        return now
    if t.startswith("now-"):
        return now - parse_duration(t[4:])
    try:
        return float(t)
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time: use now, now-2h, 2026-11-30T09:00:00Z or epoch seconds") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return at.timestamp()


class PrometheusHistory:
    """One Prometheus server, read with range queries."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        from prometheus_api_client import PrometheusConnect

        # user:password@ goes to Prometheus (requests sends it as Basic auth), never into messages or runs
        self.given = url.rstrip("/")
        self.url = strip_userinfo(self.given)
        self.timeout_s = timeout_s
        self._prom = PrometheusConnect(url=self.given, disable_ssl=True, timeout=timeout_s)

    def check(self) -> str | None:
        """None when the server answers its API, else one line naming the fix."""
        import requests

        try:
            resp = requests.get(self.given + "/api/v1/status/buildinfo", timeout=min(self.timeout_s, 5.0))
        except requests.RequestException as exc:
            return f"cannot reach Prometheus at {self.url} ({type(exc).__name__}): check --url"
        if resp.status_code != 200:
            return f"{self.url} answered HTTP {resp.status_code} on /api/v1/status/buildinfo: is --url a Prometheus?"
        return None

    def version(self) -> str | None:
        import requests

        try:
            return requests.get(self.given + "/api/v1/status/buildinfo", timeout=5.0).json()["data"]["version"]
        except (requests.RequestException, ValueError, KeyError):
            return None

    def chunks(self, start: float, end: float, step_s: float) -> list[tuple[float, float]]:
        """The window cut into ranges of at most MAX_POINTS steps each, on one grid from `start`."""
        span = step_s * (MAX_POINTS - 1)
        out, t = [], start
        while t <= end:
            out.append((t, min(end, t + span)))
            t += span + step_s
        return out

    def query_range(self, query: str, start: float, end: float, step_s: float) -> list[dict]:
        """[{"metric": labels, "values": [[t, "value"], ...]}] of one range query over one chunk."""
        import requests
        from prometheus_api_client.exceptions import PrometheusApiClientException

        try:
            return self._prom.custom_query_range(
                query, start_time=datetime.fromtimestamp(start, timezone.utc),
                end_time=datetime.fromtimestamp(end, timezone.utc), step=f"{step_s:g}s")
        except PrometheusApiClientException as exc:
            raise PrometheusError(f"Prometheus refused {query!r}: {str(exc).splitlines()[0][:200]}; check --match") \
                from None
        except requests.RequestException as exc:
            raise PrometheusError(f"cannot reach Prometheus at {self.url} ({type(exc).__name__}): check --url") \
                from None

    def active_targets(self, job: str) -> list[tuple[str, str]]:
        """(instance, base URL) of every target of `job` Prometheus scrapes now (its active targets, healthy
        or not), in instance order; the base URL is the scrape URL without its /metrics path."""
        from urllib.parse import urlsplit

        import requests

        try:
            resp = requests.get(self.given + "/api/v1/targets", params={"state": "active"}, timeout=self.timeout_s)
            active = resp.json()["data"]["activeTargets"]
        except (requests.RequestException, ValueError, KeyError) as exc:
            raise PrometheusError(f"cannot read the active targets of Prometheus at {self.url} "
                                  f"({type(exc).__name__}): check --prometheus") from None
        out = {}
        for t in active:
            labels = t.get("labels") or {}
            if labels.get("job") != job:
                continue
            parts = urlsplit(t.get("scrapeUrl", ""))
            path = parts.path[: -len("/metrics")] if parts.path.endswith("/metrics") else parts.path
            out[labels.get("instance") or parts.netloc] = f"{parts.scheme}://{parts.netloc}{path}".rstrip("/")
        return sorted(out.items())

    def query(self, query: str, at: float) -> list[dict]:
        """An instant query at `at` (epoch seconds)."""
        import requests

        try:
            resp = requests.get(self.given + "/api/v1/query", params={"query": query, "time": f"{at:.3f}"},
                                timeout=self.timeout_s)
            return resp.json()["data"]["result"] if resp.status_code == 200 else []
        except (requests.RequestException, ValueError, KeyError):
            return []
