"""SQLite schema of a cancelwatch run store.

One file holds many runs. Samples are stored long and normalised: a `series` row names one
(source, target, metric, labels) combination once, a `scrapes` row holds one attempt's clocks and
duration, and a `samples` row is just (series, scrape, value). Gaps (missed ticks, failed or
unparseable scrapes, a lost target) are rows of their own, never zeros in `samples`.

Two tables hold what a long run is read by without its millions of samples: `overview` (per series and
OVERVIEW_S bucket of the run's clock: count, min, max and last value; the writer keeps it as samples land) and
`scrape_overview` (per source and bucket: scrapes and their durations). `verdicts` keeps a verdict where one
was given as the run was recorded (a watch's live judge), with the rules' fingerprint it was given by.
These tables, and the samples' covering index, were added to schema 2 as they are: a store without them reads as
before, and gains them (empty tables for its earlier runs) the next time it is written.
"""

SCHEMA_VERSION = 2  # 2: ledger gained n, prompt_tokens, max_tokens
OVERVIEW_S = 10  # an overview bucket: a day is 8,640 of them, a few per pixel of a page's timeline

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
-- a run's series read whole (a page, a report) read this index alone: it holds the scrape and the value, so no row
-- of the table is looked up (an hour's 800 000 samples of the judged series: 1.0 s through an index of
-- (run_id, series_id), 0.4 s through this one). A window (a live judge's, per cancel) reads it too: each series
-- between its source's first and last scrape of the window (runstore/reader.py). Series first, so that a read by
-- scrape alone cannot go through it, which would read every sample of the run's series. It takes the place of that narrower
-- samples_run, which a store written before drops the next time it is written (building this one then, once: a
-- second a million samples; a store of more than MIGRATE_MAX_SAMPLES keeps samples_run, runstore/writer.py says why)
CREATE INDEX IF NOT EXISTS samples_series ON samples(series_id, run_id, scrape_id, value);
DROP INDEX IF EXISTS samples_run;
-- a window of a store that keeps samples_run reads its scrapes' samples by this, whatever the run's length
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
CREATE TABLE IF NOT EXISTS overview (
    run_id INTEGER NOT NULL,
    series_id INTEGER NOT NULL,
    bucket INTEGER NOT NULL,         -- floor((scrape mono_ns - run started_mono_ns) / OVERVIEW_S s)
    n INTEGER NOT NULL,              -- samples in the bucket (NaN ones too)
    vmin REAL,                       -- NULL when every sample in it was NaN
    vmax REAL,
    vlast REAL,
    PRIMARY KEY (run_id, series_id, bucket)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS scrape_overview (
    run_id INTEGER NOT NULL,
    source TEXT NOT NULL,
    target TEXT NOT NULL,
    bucket INTEGER NOT NULL,
    n_ok INTEGER NOT NULL,
    n_failed INTEGER NOT NULL,
    n_samples INTEGER NOT NULL,
    first_ok_mono_ns INTEGER,        -- NULL where none was ok
    last_ok_mono_ns INTEGER,
    duration_sum_ns INTEGER NOT NULL, -- of its ok scrapes
    duration_max_ns INTEGER NOT NULL,
    PRIMARY KEY (run_id, source, target, bucket)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS verdicts (
    run_id INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    judged_by TEXT NOT NULL,         -- how: "window" (a live judge) and the rules' fingerprint
    body TEXT NOT NULL,              -- JSON: analysis.verdicts.CancelVerdict.stored()
    PRIMARY KEY (run_id, request_id)
);
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

# the samples' indexes of a store written before samples_series, which one of more than MIGRATE_MAX_SAMPLES keeps
# (bench/window.py and the tests read windows on such a store, beside this schema's)
NARROW_SAMPLE_INDEXES = ("CREATE INDEX IF NOT EXISTS samples_run ON samples(run_id, series_id);\n"
                         "CREATE INDEX IF NOT EXISTS samples_scrape ON samples(run_id, scrape_id);\n")


def samples_indexes(con) -> set[str]:
    """The names of the indexes a store's samples have now (a store written before holds samples_run, not
    samples_series, until it is next written; one too big to migrate keeps it)."""
    rows = con.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'samples'")
    return {name for (name,) in rows}
