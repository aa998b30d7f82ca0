"""analysis/ghosts.py: the leaked cancels the engine's count can still hold, never more than its surplus."""

from analysis.ghosts import Ghosts


def test_ghosts_are_bounded_by_the_engines_surplus_and_cleared_when_it_is_gone():
    g = Ghosts()
    g.leaked("a", 10.0)
    g.leaked("b", 12.0)
    g.leaked("c", 13.0)
    assert g.update(engine_count=4, in_flight=1) == [] and g.count() == 3  # 3 beyond the watch's one
    assert g.oldest_age_s(20.0) == 10.0
    # the engine let one go: which is not known, the oldest is taken to have gone first
    assert g.update(engine_count=3, in_flight=1) == ["a"] and g.count() == 2
    assert g.oldest_age_s(20.0) == 8.0
    # a surplus from traffic the watch did not see never makes a ghost of its own
    assert g.update(engine_count=9, in_flight=1) == [] and g.count() == 2
    # nothing beyond what the watch has in flight: every leaked request has left
    assert sorted(g.update(engine_count=1, in_flight=1)) == ["b", "c"] and g.count() == 0
    assert g.oldest_age_s(20.0) == 0.0
