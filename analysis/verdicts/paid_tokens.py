"""The tokens the engine generated for a leaked request after its client left: the GPU time paid for nobody.

vLLM counts tokens for the whole engine (generation_tokens_total), not per request, so a leaked request's
share is read off that counter from the stop (or its entry into the engine, when that came later) to the sample
that shows the request gone (or the end of the stretch followed, while it is still there):
  - `attributed`: at every sample of that span the server counted no more than this request's sequences and
    the ledger had no other request open, so every token the counter gained was its own. Counted from the
    first sample at or after the span's start: the tokens of one scrape interval may be left out;
  - `at_most`: other requests ran beside it, so the counter's gain is a bound, counted from the last sample
    at or before the span's start, and lowered to what the request could still make (max_tokens less what
    its client had) where that is known.
A counter that fell (an engine restarted) gives no figure.
"""

from __future__ import annotations

import numpy as np

from cancelwatch.analysis.bounds import WHOLE

ATTRIBUTED = "attributed"
AT_MOST = "at_most"


def tokens_after_left(times: np.ndarray, count: np.ndarray, gen: np.ndarray, others: np.ndarray, *, n: int,
                      t_from: float, t_left: float | None, remaining: int | None) -> tuple[float | None, str | None]:
    """(tokens, ATTRIBUTED | AT_MOST) for one leaked request; (None, None) where the samples cannot say.
    `count`: requests the server counted (running + waiting) at each sample; `others`: the ledger's other
    sequences open there; `t_from`: the stop, or the request's entry when later; `t_left`: the first sample
    showing the request gone (or its abort), None while it was still there at the end of `times`."""
    ok = ~np.isnan(gen)
    end = np.inf if t_left is None else t_left
    span = np.nonzero(ok & (times >= t_from) & (times <= end))[0]
    if len(span) < 2:
        return None, None
    counts = count[span]
    alone = not np.isnan(counts).any() and (counts <= n + WHOLE).all() and (others[span] <= WHOLE).all()
    if not alone:  # a bound: from the last sample at or before the start, which no token after it escapes
        before = np.nonzero(ok & (times <= t_from))[0]
        if len(before):
            span = np.concatenate([before[-1:], span])
    g = gen[span]
    if (np.diff(g) < 0).any():  # a counter reset: the engine restarted inside the span
        return None, None
    gained = float(g[-1] - g[0])
    if alone:
        return gained, ATTRIBUTED
    if remaining is not None:
        gained = min(gained, float(max(remaining, 0)))
    return gained, AT_MOST
