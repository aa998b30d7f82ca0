"""The clients' count (collectors/sources/clients.py): a read hands out the total as it stood at the read's stamp,
not when the read ran (the sampler stamps a read at its tick and runs it a moment later), and never goes back."""

from __future__ import annotations

import time

from cancelwatch.collectors.sources.clients import METRIC, ClientsSource


def test_a_read_gives_the_count_as_it_stood_at_its_stamp():
    src = ClientsSource("t0")
    before = time.monotonic_ns()
    src.add(3)
    between = time.monotonic_ns()
    src.add(2)
    after = time.monotonic_ns()
    src.add(4)  # after every stamp below: in none of the reads
    (s,) = src.sample(0, before - 1)
    assert (s.source, s.metric, s.value) == ("clients", METRIC, 0.0)
    assert src.sample(0, between)[0].value == 3.0
    assert src.sample(0, after)[0].value == 5.0
    assert src.sample(0, time.monotonic_ns())[0].value == 9.0
    assert src.sample(0, time.monotonic_ns())[0].value == 9.0  # nothing new: the same total
