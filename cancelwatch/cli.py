"""The `cancelwatch` command line. Settings are read here, at the edge, and passed down.

One module per command group: engine_commands (engine up/down/status), sampling_commands (sample,
summary, runs, export, load), cancel_commands (record), report_commands (report, notebook),
import_commands (import prometheus), canary_commands (canary), matrix_commands (matrix), watch_commands
(watch).
"""

from __future__ import annotations

import signal
import sys

import typer

from cancelwatch import canary_commands, cancel_commands, matrix_commands, report_commands, sampling_commands, \
    watch_commands
from cancelwatch.console import EXIT_USAGE, fail
from cancelwatch.engine_commands import engine_app
from cancelwatch.import_commands import import_app
from cancelwatch.runstore.errors import StoreError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="cancelwatch: does a cancelled LLM request really leave the engine?")
app.add_typer(engine_app, name="engine")
app.add_typer(import_app, name="import")
for command in (sampling_commands.sample, sampling_commands.summary, sampling_commands.runs, sampling_commands.export,
                sampling_commands.load):
    app.command()(command)
app.command("record")(cancel_commands.record_cmd)
app.command()(canary_commands.canary)
app.command()(watch_commands.watch)
app.command()(matrix_commands.matrix)
app.command()(report_commands.report)
app.command()(report_commands.notebook)


def main() -> None:
    # a command started by `&` in a script (or under a parent that ignores it) inherits SIGINT ignored,
    # and Python then never raises KeyboardInterrupt: the dashboard's Stop and `kill -INT` would be lost,
    # and a run meant to end as interrupted went on (seen when the test suite ran as a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except StoreError as exc:
        # a run the analysis cannot read as asked (one of an engine family it has no rules for, ...), met
        # past a command's own checks: its one line, never a traceback
        fail(str(exc))
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
