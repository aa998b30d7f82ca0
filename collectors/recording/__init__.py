"""Recording a run: the sampler (every source on its own tick grid) and the session that owns a run from preflight to finish."""
