"""The engine families cancelwatch records, one entry each: how a target of the family is recognised,
the source that reads its scheduler (what the driver's idle and reconcile checks read), and the `record`
options that do not apply to it, each with why (refused in one line, never dropped in silence).

It sits above the four rooms: the one module of collectors that may read sources, recording, cancels and
engines together (tests/test_layering.py says so). The command line picks a target's family here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from collectors.recording.triton_session import is_triton_target
from collectors.sources import triton as triton_source
from collectors.sources import vllm as vllm_source


@dataclass(frozen=True)
class Family:
    """name: the family a run's targets record; recognises: whether a --target is one of the family's;
    scheduler_source: the source name of its scheduler samples; record_refuses: `record` option -> why it
    does not apply to this family."""

    name: str
    recognises: Callable[[str], bool]
    scheduler_source: str
    record_refuses: Mapping[str, str] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # first match wins: Triton's gRPC address is recognised by its scheme, every http(s) target is vLLM's
    Family(triton_source.FAMILY, is_triton_target, triton_source.SOURCE_NAME, {
        "--burst-hz": "the Triton scenarios do not raise the sampling rate around their stops",
        "--api-key-env": "cancelwatch sends Triton's gRPC and HTTP endpoints no API key",
        "--relay-url": "the relay app serves vLLM's AsyncLLM in process (the inproc scenario); Triton has none",
        "--prometheus": "replica discovery samples vLLM replicas of a scrape job; a Triton run samples its one server",
    }),
    Family(vllm_source.FAMILY, lambda target: True, vllm_source.SOURCE_NAME, {
        "--http-url": "it is Triton's HTTP endpoint; a vLLM server is reached at --target",
    }),
)}


def family_for_target(target: str) -> Family:
    """The family whose targets look like `target` (the first in FAMILIES that recognises it)."""
    return next(f for f in FAMILIES.values() if f.recognises(target))


def refused_option(family: Family, given: Mapping[str, object]) -> str | None:
    """The one-line refusal of the first option in `given` (option -> value, None: not given) that does not
    apply to `family`; None when every given option applies."""
    for option, value in given.items():
        if value is not None and option in family.record_refuses:
            return (f"{option} does not apply to a {family.name} target: {family.record_refuses[option]}; "
                    "leave it out")
    return None
