"""SQLite schema of a cancelwatch run store.

One file holds many runs. Samples are stored long and normalised: a `series` row names one
(source, target, metric, labels) combination once, a `scrapes` row holds one attempt's clocks and
duration, and a `samples` row is just (series, scrape, value). Gaps (missed ticks, failed or
unparseable scrapes, a lost target) are rows of their own, never zeros in `samples`.
"""

SCHEMA_VERSION = 2  # 2: ledger gained n, prompt_tokens, max_tokens

DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT,
    started_wall_ns INTEGER NOT NULL,
    started_mono_ns INTEGER NOT NULL,
    ended_wall_ns INTEGER,
    status TEXT NOT NULL,            -- running | completed | interrupted | target_lost | failed
    targets TEXT NOT NULL,           -- JSON list of {label, url}
    engine TEXT NOT NULL DEFAULT '{}',   -- JSON: embedded engine facts (pid, model, flags)
    cache TEXT NOT NULL DEFAULT '{}',    -- JSON: per target label, vllm:cache_config_info labels
    settings TEXT NOT NULL DEFAULT '{}', -- JSON: sampler settings
    stats TEXT NOT NULL DEFAULT '{}'     -- JSON: per source taken/written/missed/errors, set at the end
);
CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    metric TEXT NOT NULL,
    labels TEXT NOT NULL             -- JSON object, keys sorted
);
CREATE UNIQUE INDEX IF NOT EXISTS series_key ON series(run_id, source, target, metric, labels);
CREATE TABLE IF NOT EXISTS scrapes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    tick INTEGER NOT NULL,           -- index of the scheduled tick this scrape served
    wall_ns INTEGER NOT NULL,        -- when the scrape started, time.time_ns()
    mono_ns INTEGER NOT NULL,        -- when the scrape started, time.monotonic_ns()
    duration_ns INTEGER NOT NULL,
    ok INTEGER NOT NULL,             -- 1: samples stored; 0: see gaps
    n_samples INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS scrapes_run ON scrapes(run_id, source, target, mono_ns);
CREATE TABLE IF NOT EXISTS samples (
    run_id INTEGER NOT NULL,
    series_id INTEGER NOT NULL REFERENCES series(id),
    scrape_id INTEGER NOT NULL REFERENCES scrapes(id),
    value REAL                       -- NULL only when the server sent NaN
);
CREATE INDEX IF NOT EXISTS samples_run ON samples(run_id, series_id);
-- a window of a run (a live judge's, per cancel) reads its scrapes' samples alone, whatever the run's length
CREATE INDEX IF NOT EXISTS samples_scrape ON samples(run_id, scrape_id);
CREATE TABLE IF NOT EXISTS gaps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    kind TEXT NOT NULL,              -- missed | error | parse_error | lost
    start_wall_ns INTEGER NOT NULL,
    start_mono_ns INTEGER NOT NULL,
    end_mono_ns INTEGER NOT NULL,
    ticks INTEGER NOT NULL,          -- scheduled ticks that produced no samples
    detail TEXT
);
CREATE INDEX IF NOT EXISTS gaps_run ON gaps(run_id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id),
    request_id TEXT,
    kind TEXT NOT NULL,
    wall_ns INTEGER NOT NULL,
    mono_ns INTEGER NOT NULL,
    data TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id, mono_ns);
CREATE TABLE IF NOT EXISTS ledger (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    request_id TEXT NOT NULL,
    scenario TEXT,
    role TEXT,                       -- target | neighbour | probe | filler
    n INTEGER NOT NULL DEFAULT 1,    -- sequences the server runs for it (the n of a completion)
    prompt_tokens INTEGER,
    max_tokens INTEGER,
    sent_mono_ns INTEGER,
    first_token_mono_ns INTEGER,
    chunks INTEGER,
    tokens_after_cancel INTEGER,
    cancel_mono_ns INTEGER,
    closed_mono_ns INTEGER,
    terminal_state TEXT,             -- completed | cancelled | error
    reason TEXT,                     -- finish_reason, or how it was cancelled
    error TEXT,
    PRIMARY KEY (run_id, request_id)
);
"""

