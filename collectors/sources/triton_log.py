"""Triton's own log as a source: the lines cancelwatch's models write for each request.

The models (engines/triton_models) log with pb_utils.Logger, which Triton writes in its default
format with microseconds and no year:
    I1130 09:09:22.090905 15924 model.py:69] "cancelwatch model=generator request=<id> event=started tokens=100 poll=true"
`event` is started | cancelled [step=k] | finished | error <type>; `<id>` is the request id the
client sent (gRPC/HTTP `id`), unchanged. Each line becomes an event on the run's clock, like the vLLM
engine log's: `engine_added` (the model started it), `engine_aborted` (the model saw the cancel and
stopped), `engine_finished` (it ran to its end: for a cancelled request, the server ran it for nobody).
A request the core dropped while queued never reaches the model, so it has no line: the core's
`nv_inference_request_failure{reason="CANCELED"}` is the evidence there.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

from cancelwatch.collectors.sources.engine_log import EngineLogSource
from cancelwatch.runstore.records import EventRecord

SOURCE_NAME = "triton_log"

_LINE = re.compile(r"^[IWE](?P<month>\d{2})(?P<day>\d{2}) (?P<time>\d{2}:\d{2}:\d{2})\.(?P<us>\d{6}) +\d+ "
                   r"[^\]]*\] \"cancelwatch model=(?P<model>\S+) request=(?P<rid>\S+) event=(?P<event>\w+)"
                   r"(?P<detail>[^\"]*)\"\s*$")
KINDS = {"started": "engine_added", "cancelled": "engine_aborted", "finished": "engine_finished",
         "error": "engine_finished"}


def parse_triton_line(line: str, year: int) -> tuple[str, str, str, int, str] | None:
    """(kind, request id, model, wall-clock ns, detail) of a model's request line, else None.

    Triton stamps its log in UTC whatever the host's time zone, without a year: the year is the one of
    `year`-1, `year`, `year`+1 that puts the line nearest to now (a run across New Year)."""
    m = _LINE.match(line)
    if m is None or m.group("event") not in KINDS:
        return None
    now = datetime.now(timezone.utc).timestamp()
    stamps = []
    for y in (year - 1, year, year + 1):
        try:
            at = datetime.strptime(f"{y}-{m.group('month')}-{m.group('day')} {m.group('time')}", "%Y-%m-%d %H:%M:%S")
        except ValueError:  # 29 February of a year that has none
            continue
        stamps.append(int(at.replace(tzinfo=timezone.utc).timestamp()))
    if not stamps:
        return None
    secs = min(stamps, key=lambda x: abs(x - now))
    wall_ns = secs * 1_000_000_000 + int(m.group("us")) * 1000
    detail = (m.group("event") + m.group("detail")).strip()
    return KINDS[m.group("event")], m.group("rid"), m.group("model"), wall_ns, detail


class TritonLogSource(EngineLogSource):
    """Follows tritonserver's log (the embedded one's, or `--engine-log PATH`) for the models' lines."""

    name = SOURCE_NAME

    def check(self) -> str | None:
        problem = super().check()
        return problem and problem.replace("(vLLM started with --enable-log-requests)",
                                           "(tritonserver's log, with cancelwatch's models)")

    def _take(self, line: str) -> None:
        if "cancelwatch model=" not in line:
            return
        parsed = parse_triton_line(line, self._year)
        if parsed is None:
            return
        kind, rid, model, line_wall_ns, detail = parsed
        if kind == "engine_added":
            self.added += 1
        elif kind == "engine_aborted":
            self.aborted += 1
        self._events.append(EventRecord(
            kind=kind, wall_ns=line_wall_ns, mono_ns=line_wall_ns - self._wall_minus_mono, request_id=rid,
            data={"engine_request_id": rid, "model": model, "detail": detail, "clock": "engine_log",
                  "resolution_s": 1e-6, "target": self.target}))
