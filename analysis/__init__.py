"""cancelwatch analysis: pure functions from runs (pandas) to results and figures. No I/O beyond the store reader."""
