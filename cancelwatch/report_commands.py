"""`cancelwatch report|notebook`: verdicts of a recorded run, as a table, JSON, HTML or a rendered notebook."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from cancelwatch.console import DEFAULT_STORE, err, fail, out
from cancelwatch.collectors.recording.session import EXIT_FAILED
from cancelwatch.runstore.errors import StoreError
from cancelwatch.runstore.extras import lacking, missing

if TYPE_CHECKING:
    from cancelwatch.analysis.verdicts import CancelVerdict


def report_exit(doc: dict) -> int:
    # the one acceptance rule, also stated in the protocol of --protocol
    from cancelwatch.analysis.protocol import accepted

    return 0 if accepted(doc) else EXIT_FAILED


FORMATS = ("table", "json", "csv")
FORMAT_HELP = ("table: the cancels as a table (in a log or a pipe, each cancel's reason on a line of its own under "
               "it); json: the report document (as --json); csv: one row per cancel, the dashboard's cancel table.")


def checked_format(value: str) -> str:
    """--format, checked before any work: one line naming the choices."""
    if value not in FORMATS:
        raise fail(f"--format {value!r}: use one of {', '.join(FORMATS)}, e.g. --format csv")
    return value


def print_as(fmt: str, run, doc: dict, verdicts: list[CancelVerdict]) -> None:
    """The report of `run` in one of FORMATS: the table (print_report), the document as JSON, or the cancels as CSV
    (analysis/cancel_table.py: the columns the dashboard's cancel table shows)."""
    import json

    if fmt == "json":
        print(json.dumps(doc, indent=1, default=str))
    elif fmt == "csv":
        from cancelwatch.analysis.cancel_table import cancel_table

        sys.stdout.write(cancel_table(run, verdicts).to_csv(index=False))
    else:
        print_report(doc, verdicts)


def print_report(doc: dict, verdicts: list[CancelVerdict]) -> None:
    """The cancels as a table (latency columns named as in the dashboard's cancel table), then the
    neighbours' outcome; `doc` is the run's report_document, `verdicts` the cancels it was made of. Where the
    output is no terminal (a log, a pipe), each cancel's reason is a line under the table instead of a column: a
    sentence wrapped in a column took six lines a cancel."""
    from cancelwatch.analysis.ghosts import IN_ENGINE
    from cancelwatch.analysis.verdicts import LATENCIES, STOP_TO_ABORT, latency_label

    # the latencies a reader needs at a glance; the app's own point, where there is one, is in --json
    shown = (STOP_TO_ABORT, *LATENCIES[2:])
    colours = {"released": "green", "leaked": "red", "stale_gauge": "yellow", "inconclusive": "magenta"}
    inline = out.is_terminal
    table = Table(title=f"run {doc['run_id']} ({doc['status']}): cancels")
    for col in ("scenario", "request", "phase", "verdict", *(latency_label(a, b) for a, b in shown),
                "engine abort from", *(("why",) if inline else ())):
        table.add_column(col)
    reasons = []
    for v in verdicts:
        lat = (v.latency_ms(a, b) for a, b in shown)
        fmt = ["" if x is None else f"{x:.0f}" for x in lat]
        why = v.evidence.why or v.evidence.race or ""
        abort_from = v.source_label("engine_abort") or v.source_reason("engine_abort")
        table.add_row(v.scenario, v.request_id[-8:], v.phase_at_cancel,
                      f"[{colours.get(v.verdict, 'white')}]{v.verdict}[/]", *fmt, abort_from or "",
                      *((why,) if inline else ()))
        if why and not inline:
            reasons.append(f"  {v.request_id[-8:]}: {why}")
    # in a log, the table as wide as its cells: a column cut to a width no reader has is text lost
    out.print(table, width=None if inline else Console(width=10_000).measure(table).maximum)
    for line in reasons:
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    paid = [(v.evidence.tokens_after_client_left, v.evidence.tokens_after_client_left_is) for v in verdicts
            if v.evidence.tokens_after_client_left is not None]
    if paid:  # what the leaks cost: the engine's own tokens, not what the clients were sent
        exact = sum(n for n, how in paid if how == "attributed")
        bound = sum(n for n, how in paid if how != "attributed")
        out.print(f"tokens the engine made after leaked cancels' clients left: {exact + bound:.0f} "
                  f"({exact:.0f} attributed, at most {bound:.0f} shared with other requests)", highlight=False)
    held = [g for g in doc.get("ghosts") or [] if g["in_engine"] == IN_ENGINE]
    if held:  # the engine's count still held them at the last sample: running for nobody
        out.print(f"ghosts: {len(held)} leaked request(s) still in the engine at the last sample: "
                  + ", ".join(f"{g['request_id']} ({g['age_s']:.0f} s since its client left)" for g in held),
                  highlight=False)
    pages = [v for v in verdicts if (v.sources.get("user_stop") or {}).get("source") == "page"]
    if doc.get("page_reports"):  # where the first timepoint came from: a page's Stop click, or the client's close
        out.print(f"user stop: {len(pages)} of {len(verdicts)} cancel(s) timed by their page's Stop click "
                  f"({', '.join(v.request_id[-8:] for v in pages) or 'none'}); the others by the client side's close",
                  highlight=False)
    for r in doc.get("page_reports") or []:
        if not r["used"]:
            out.print(f"note: a page's report of a Stop (task {r['task_id']}, request {r['request_id']}) is kept, "
                      f"not used: {r['note']}", highlight=False)
    for note in doc.get("engine_log_notes") or []:  # what to know of the engine log before the verdicts
        out.print(f"note: {note}", highlight=False)
    for a in doc.get("assumptions") or []:  # what the verdicts rest on, where the run's own evidence says otherwise
        if a["contradicted"]:
            out.print(f"note: {a['verdicts']} verdict(s) assume {a['assumption']} ({a['what']}); the run's own "
                      f"evidence says otherwise: {a['contradicted']}", highlight=False)
    if doc.get("watch"):
        w = doc["watch"]
        out.print(f"watched: {w['requests']} request(s) through {w['listen']} -> {w['upstream']}, "
                  f"{len(doc['cancels'])} cancel(s)", highlight=False)
    else:
        out.print(f"neighbours ok: {doc['neighbours_ok']}")


def _check_html_folder(html_out: Path) -> None:
    """Before any work: an --html file whose folder is missing is a usage error."""
    if not html_out.parent.is_dir():
        raise fail(f"--html {html_out}: the folder {html_out.parent} does not exist; create it or write elsewhere")


def write_protocol(r, doc: dict, protocol_out: Path) -> None:
    """The run's acceptance protocol (Markdown) into `protocol_out`; a path that cannot be written is
    a one-line error naming it (raise what `fail` returns)."""
    from dataclasses import asdict

    from cancelwatch.analysis.protocol import protocol_markdown
    from cancelwatch.collectors.cancels.scenarios import BUILTIN

    text = protocol_markdown(r, doc, builtin={name: asdict(s) for name, s in BUILTIN.items()})
    if not protocol_out.parent.is_dir():
        raise fail(f"--protocol {protocol_out}: the folder {protocol_out.parent} does not exist; create it or "
                   "write elsewhere")
    try:
        protocol_out.write_text(text)
    except OSError as exc:
        raise fail(f"cannot write {protocol_out} ({exc.strerror}): choose a writable path for --protocol") from None
    print(f"wrote {protocol_out}", file=sys.stderr)


def report(run: str = typer.Argument("latest"), store: Path = typer.Option(DEFAULT_STORE),
           as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (--format json)."),
           format_: str = typer.Option("table", "--format", help=FORMAT_HELP),
           grace: float | None = typer.Option(None, help="Grace window in s; default: the run's own."),
           html_out: Path | None = typer.Option(None, "--html", help="Also write a self-contained HTML report "
                                                   "(the dashboard's figures, opens offline) to this file."),
           protocol_out: Path | None = typer.Option(None, "--protocol", help="Also write the run's acceptance "
                                                       "protocol (Markdown) to this file."),
           context_len: int = typer.Option(2048, help="Context length (tokens) for the capacity figures of --html.")):
    """The per-cancel table (verdicts with evidence) of a recorded run."""
    import json

    from cancelwatch.analysis.verdicts import report_document

    fmt = "json" if as_json else checked_format(format_)
    if html_out is not None:
        # the page's figures, without the page: plotly and its downsampler, which the [dashboard] extra brings
        if (need := lacking("dashboard", ("plotly", "tsdownsample"), "report --html's figures")) is not None:
            raise fail(need)
        _check_html_folder(html_out)
    if context_len <= 0:
        raise fail(f"--context-len {context_len}: give a positive number of tokens, e.g. --context-len 2048")
    try:
        r, verdicts = judged_run(store, run, grace)  # without --grace, the run's own
    except StoreError as exc:
        raise fail(str(exc)) from None
    doc = report_document(r, verdicts=verdicts)
    if html_out is not None:
        from cancelwatch.analysis.html_report import report_html

        try:
            html_out.write_text(report_html(r, verdicts, context_len=context_len))
        except OSError as exc:
            raise fail(f"cannot write {html_out} ({exc.strerror}): choose a writable path for --html") from None
        print(f"wrote {html_out}", file=sys.stderr)
    print_as(fmt, r, doc, verdicts)
    if protocol_out is not None:
        # after the report: a protocol that cannot be written loses nothing else
        sys.stdout.flush()
        write_protocol(r, doc, protocol_out)
    raise typer.Exit(report_exit(doc))


def judged_run(store: Path, run: str | int, grace: float | None, keep: bool = False, long_run_s: float | None = None):
    """(run, verdicts). A long run (analysis/long_runs.py: a day's watch or record; longer than `long_run_s`
    where given) is read at its overview's resolution, its cancels' verdicts those stored with it by these
    rules, the rest judged each on its own window: never the whole run, which a day of samples would not fit.
    `keep`: store those judged here with the run (the recorder's own tail does; a report only reads). Any other
    run is read whole and judged."""
    from cancelwatch.analysis.judged import judged_run as judged
    from cancelwatch.analysis.verdicts import run_grace_s

    got = judged(store, run, grace, long_run_s=long_run_s)
    r, verdicts = got.run, got.verdicts
    if got.long and keep and (grace is None or grace == run_grace_s(r)):  # kept as judged with the run's own grace
        from cancelwatch.analysis.verdicts.stored import judged_by, stored, usable

        have = set(usable(got.stored_rows))
        new = [v for v in verdicts if v.request_id not in have]
        if new:
            _keep(store, r.id, judged_by(), [(v.request_id, stored(v)) for v in new])
    return r, verdicts


def _keep(store: Path, rid: int, how: str, rows: list) -> None:
    """The verdicts the recorder's tail judged, kept with the run; a store that takes no more (a full disk: the
    run may have ended for it) is said in one line, and the report goes on from the verdicts in hand."""
    from cancelwatch.runstore.writer import keep_verdicts

    try:
        keep_verdicts(store, rid, how, rows)
    except StoreError as exc:
        err.print(f"{len(rows)} verdict(s) not kept in the run: {exc}", highlight=False)


def _here(path: str | Path) -> str:
    """A path as the user meant it: relative to the working directory of the command."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else Path.cwd() / p)


def notebook(name: str = typer.Argument(..., help="capacity_review, vram_plateau, resolution or explore (notebooks/NAME.ipynb)."),
             run: list[str] = typer.Option(["latest"], "--run", help="Run id or 'latest'; repeat for several runs."),
             store: Path = typer.Option(DEFAULT_STORE, help="Run store (SQLite)."),
             param: list[str] = typer.Option([], "-p", "--param", help="Another notebook parameter as KEY=VALUE: "
                                             "-p context_len=4096"),
             html_out: Path = typer.Option(..., "--html", help="Where to write the rendered HTML (no code cells)."),
             ipynb_out: Path | None = typer.Option(None, "--ipynb", help="Also keep the executed notebook.")):
    """Execute a notebook on runs with papermill and render it to HTML (plotly embedded, opens offline)."""
    if (need := missing("notebooks")) is not None:
        raise fail(need)
    import papermill as pm

    from cancelwatch.notebooks.render import NOTEBOOKS, NotebookError, available, coerce, render

    if name not in available():
        raise fail(f"no notebook {name!r}: choose one of {', '.join(available())}")
    _check_html_folder(html_out)
    known = set(pm.inspect_notebook(str(NOTEBOOKS / f"{name}.ipynb")))
    # the kernel runs in the project root: a store named relative to where the command runs is passed on
    # absolute (the default store when it is not here is left to the notebook: the store folder, or the sample)
    params: dict = {"store": str(store) if str(store) == str(DEFAULT_STORE) and not store.exists() else _here(store)}
    if "run_ids" in known:
        params["run_ids"] = ",".join(run)
    elif len(run) > 1:
        raise fail(f"{name} walks through one run: give --run once")
    else:
        params["run"] = run[0]
    for item in param:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise fail(f"-p {item}: write KEY=VALUE, e.g. -p context_len=4096")
        if key not in known:
            raise fail(f"-p {key}: {name} has no such parameter; it takes {', '.join(sorted(known))}")
        params[key] = _here(value) if key.endswith("store") else coerce(value)
    try:
        render(name, params, html_out, ipynb_out)
    except NotebookError as exc:
        from rich.markup import escape

        err.print(f"[bold red]error:[/] {escape(f'{exc} (the error cell is in {html_out})')}", highlight=False,
                  soft_wrap=True)
        raise typer.Exit(1) from None
    print(f"wrote {html_out}", file=sys.stderr)

