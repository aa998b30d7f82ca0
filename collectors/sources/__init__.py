"""Where the samples come from: one module per thing read, each behind the Source protocol (base)."""
