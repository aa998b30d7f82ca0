"""The engine families cancelwatch records, one entry each: how a target of the family is recognised, its
sources, its driver, its scenarios, its launcher, the source that reads its scheduler (what the driver's
idle and reconcile checks read) and the sources a burst lifts around a stop, the modules that are the
family's own, and the options and commands that do not apply to it, each with why (refused in one line,
never dropped in silence).

It sits above the four rooms: the one module of collectors that may read sources, recording, cancels and
engines together (tests/test_layering.py says so). `record`, `sample` and `canary` pick a target's family
here. A family's name is written as a literal only here and in its own modules (tests/test_families.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

from cancelwatch.collectors.cancels import scenarios as vllm_scenarios
from cancelwatch.collectors.cancels.driver import Driver
from cancelwatch.collectors.cancels.triton_driver import TritonDriver, resolve_triton
from cancelwatch.collectors.engines import triton_server, vllm_server
from cancelwatch.collectors.recording.triton_session import build_triton_sources, is_triton_target
from cancelwatch.collectors.recording.vllm_session import build_vllm_sources
from cancelwatch.collectors.sources import triton as triton_source
from cancelwatch.collectors.sources import vllm as vllm_source


@dataclass(frozen=True)
class Family:
    """name: the family a run's targets record; recognises: whether a --target is one of the family's;
    scenarios: `--scenario` -> the family's scenarios (ValueError or ScenarioError naming the fix);
    sources: builds the run's sources and engine facts (PreflightError before any run exists); driver: the
    scenario runner of the family; launcher: its embedded engine (`engine up`, the state files it owns);
    scheduler_source: the source name of its scheduler samples; burst_sources: the sources a burst reads
    fast around a stop (none: the family's scenarios do not burst); modules: the family's own modules
    (repository paths), where its name may be written; record_refuses: `record` option -> why it does not
    apply; command_refuses: command -> why it does not apply to the family's targets."""

    name: str
    recognises: Callable[[str], bool]
    scenarios: Callable[[str], list]
    sources: Callable[..., tuple[list, dict]]
    driver: type
    launcher: ModuleType
    scheduler_source: str
    burst_sources: frozenset[str]
    modules: tuple[str, ...]
    record_refuses: Mapping[str, str] = field(default_factory=dict)
    command_refuses: Mapping[str, str] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # first match wins: Triton's gRPC address is recognised by its scheme, every http(s) target is vLLM's
    Family(
        triton_source.FAMILY, is_triton_target, resolve_triton, build_triton_sources, TritonDriver, triton_server,
        triton_source.SOURCE_NAME, frozenset(),
        ("collectors/sources/triton.py", "collectors/sources/triton_log.py", "collectors/engines/triton_server.py",
         "collectors/recording/triton_session.py", "collectors/cancels/triton_driver.py",
         "collectors/cancels/triton_calls.py", "analysis/verdicts/triton.py"),
        record_refuses={
            "--burst-hz": "the Triton scenarios do not raise the sampling rate around their stops",
            "--burst-window": "the Triton scenarios do not raise the sampling rate around their stops",
            "--api-key-env": "cancelwatch sends Triton's gRPC and HTTP endpoints no API key",
            "--relay-url": "the relay app serves vLLM's AsyncLLM in process (the inproc scenario); Triton has none",
            "--prometheus": "replica discovery samples vLLM replicas of a scrape job; a Triton run samples its one "
                            "server",
            "--job": "replica discovery samples vLLM replicas of a scrape job; a Triton run samples its one server",
            "user:password@ in --target": "cancelwatch sends Triton's gRPC and HTTP endpoints no credentials",
            "--engine-log-tz": "tritonserver stamps its log in UTC, and cancelwatch reads it so",
            "--hop": "a tap reads HTTP/1.1 request heads, and Triton's cancels travel over gRPC (HTTP/2)",
        },
        command_refuses={
            "sample": "sampling alone reads vLLM's /metrics; `cancelwatch record --target grpc://HOST:PORT` samples "
                      "Triton's metrics, log and memory while it cancels",
            "canary": "the canary's rounds are vLLM's HTTP scenarios; run Triton's with `cancelwatch record --target "
                      "grpc://HOST:PORT --scenario triton`",
            "watch": "the watch taps HTTP/1.1 traffic and judges it on vLLM's /metrics and log; Triton's gRPC "
                     "cancels are recorded with `cancelwatch record --target grpc://HOST:PORT --scenario triton`",
        }),
    Family(
        vllm_source.FAMILY, lambda target: True, vllm_scenarios.resolve, build_vllm_sources, Driver, vllm_server,
        vllm_source.SOURCE_NAME, frozenset({vllm_source.SOURCE_NAME}),
        ("collectors/sources/vllm.py", "collectors/sources/engine_log.py", "collectors/engines/vllm_server.py",
         "collectors/engines/relay_app.py", "collectors/recording/vllm_session.py", "collectors/cancels/driver.py",
         "collectors/cancels/scenarios.py", "analysis/verdicts/vllm.py", "analysis/verdicts/vllm_case.py",
         "analysis/verdicts/vllm_frames.py", "analysis/verdicts/vllm_log.py"),
        record_refuses={"--http-url": "it is Triton's HTTP endpoint; a vLLM server is reached at --target"}),
)}


def family_for_target(target: str) -> Family:
    """The family whose targets look like `target` (the first in FAMILIES that recognises it)."""
    return next(f for f in FAMILIES.values() if f.recognises(target))


def discovered_family() -> Family:
    """The family of the replicas `--prometheus` discovers: vLLM's (its series name the scrape job's targets)."""
    return FAMILIES[vllm_source.FAMILY]


def family_of_state(state) -> Family | None:
    """The family whose launcher owns an embedded engine's state file; None for a kind no launcher here
    writes (a newer cancelwatch's)."""
    return next((f for f in FAMILIES.values() if f.launcher.owns(state)), None)


def refused_option(family: Family, given: Mapping[str, object]) -> str | None:
    """The one-line refusal of the first option in `given` (option -> value, None: not given) that does not
    apply to `family`; None when every given option applies."""
    for option, value in given.items():
        if value is not None and option in family.record_refuses:
            return (f"{option} does not apply to a {family.name} target: {family.record_refuses[option]}; "
                    "leave it out")
    return None


def refused_command(family: Family, command: str) -> str | None:
    """The one-line refusal of `command` for the family's targets; None when it applies."""
    why = family.command_refuses.get(command)
    return f"{command} does not apply to a {family.name} target: {why}" if why else None
