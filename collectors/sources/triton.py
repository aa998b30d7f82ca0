"""Triton Inference Server's Prometheus `/metrics` (the metrics port) as a source.

Built on the generic Prometheus-text reader (prom_text); nothing vLLM-specific. Per model it keeps
the core's pending gauge, request success and failure{reason} counters, exec and inference counts,
cumulative durations, and the models' own series (cancelwatch's models publish their active
requests, generation steps and cancels seen with pb_utils.MetricFamily); per server the CPU and GPU
memory series where the build sends them. Where the meaning matches vLLM's, the common names are
added: `requests_waiting` (the core's pending requests, all models) and `requests_running` (the
models' own active gauges, all models), so the figures and the scheduler readers need no Triton case.
"""

from __future__ import annotations

import re

from cancelwatch.collectors.sources.base import ParseError, SourceError
from cancelwatch.collectors.sources.prom_text import LineMemo, PromTextSource, json_version, sample_name
from cancelwatch.runstore.records import Sample

SOURCE_NAME = "triton"
# the engine family of a target this source reads (each of a run's targets records it)
FAMILY = "triton"

NAMES: dict[str, str] = {
    "nv_inference_pending_request_count": "triton_pending_requests",
    "nv_inference_request_success": "triton_request_success_total",
    "nv_inference_request_failure": "triton_request_failure_total",
    "nv_inference_count": "triton_inference_count_total",
    "nv_inference_exec_count": "triton_exec_count_total",
    "nv_inference_request_duration_us": "triton_request_duration_us_total",
    "nv_inference_queue_duration_us": "triton_queue_duration_us_total",
    "nv_inference_compute_infer_duration_us": "triton_compute_infer_duration_us_total",
    "nv_cpu_memory_used_bytes": "cpu_memory_used_bytes",
    "nv_cpu_memory_total_bytes": "cpu_memory_total_bytes",
    # Triton's own reading of the GPUs, apart from NVML's (same meaning, another sampler)
    "nv_gpu_memory_used_bytes": "triton_gpu_memory_used_bytes",
    "nv_gpu_memory_total_bytes": "triton_gpu_memory_total_bytes",
    "cancelwatch_model_active_requests": "model_active_requests",
    "cancelwatch_model_steps_total": "model_steps_total",
    "cancelwatch_model_cancels_seen_total": "model_cancels_seen_total",
    "cancelwatch_model_buffer_bytes": "model_buffer_bytes",
}
# the common names, summed over models: what the figures and the scheduler readers read
COMMON = {"triton_pending_requests": "requests_waiting", "model_active_requests": "requests_running"}

_LINE = re.compile(r"^(?:nv_|cancelwatch_model_)[^\n]*", re.MULTILINE)


def _lines(text: str) -> list[str]:
    return [line for line in _LINE.findall(text)
            if not sample_name(line).endswith(("_bucket", "_created")) and "quantile=" not in line]


def parse_triton_metrics(text: str, wall_ns: int, mono_ns: int, source: str = SOURCE_NAME,
                         memo: LineMemo | None = None) -> list[Sample]:
    """The Triton series of one /metrics body as Samples under the names above (others keep theirs),
    plus the common `requests_waiting`/`requests_running` sums. Raises ParseError for a body that is
    not Prometheus text, is cut short, or holds no Triton series."""
    if not text.endswith("\n"):
        raise ParseError("truncated /metrics body (no final newline)")
    parsed = (memo or LineMemo()).parse(_lines(text))
    if not any(name.startswith("nv_inference_") for name, _, _ in parsed):
        raise ParseError("no nv_inference_ series in the /metrics body: is this Triton's metrics port?")
    out: list[Sample] = []
    sums: dict[str, float] = {}
    for name, labels, value in parsed:
        metric = NAMES.get(name, name)
        out.append(Sample(source, metric, value, labels, wall_ns, mono_ns))
        if metric in COMMON:
            sums[COMMON[metric]] = sums.get(COMMON[metric], 0.0) + value
    out += [Sample(source, metric, value, (), wall_ns, mono_ns) for metric, value in sums.items()]
    return out


def server_version(http_url: str, timeout_s: float = 2.0) -> str | None:
    """Triton's own version from its `GET /v2` (server metadata); None when it does not say."""
    return json_version(http_url.rstrip("/") + "/v2", timeout_s)


class TritonMetricsSource(PromTextSource):
    """One Triton server's metrics port (see prom_text.MetricsEndpoint for how it is read)."""

    name = SOURCE_NAME

    def parse(self, text: str, wall_ns: int, mono_ns: int, memo: LineMemo | None = None) -> list[Sample]:
        return parse_triton_metrics(text, wall_ns, mono_ns, memo=memo)

    def lines(self, text: str) -> list[str]:
        return _lines(text)

    def unreadable(self, exc: SourceError) -> str:
        return (f"cannot read Triton metrics at {self.metrics_url} ({exc}): start it "
                "(cancelwatch engine up --engine triton) or fix --metrics-url (Triton's metrics port, 8002)")
