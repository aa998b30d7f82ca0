"""Which ledger request each engine log line is of.

vLLM builds a request's id from the client's X-Request-Id (`cmpl-<X-Request-Id>-<prompt>-<8 hex>`), and
the engine log source reads the client id back from it (`ledger_id` picks the ledger's id where a client
id itself ends like vLLM's suffixes). A gateway that mints its own id (many OpenAI-compatible proxies do)
sends the engine another X-Request-Id: every line then names a request the ledger does not know, the
cancelled one included, and each cancel reads as other traffic.

Such a line is matched to a ledger request by when it entered the engine: a request's `Added request`
line is written after the client sent it and before its first token came back (before its client
closed it, for one stopped while queued). A line that falls in the window of a ledger request that no
line names, as the only unknown line left there (once the lines other requests must have are taken), is
that request's, unless it is another request's only line too. Requests sent together share a window:
where none of them was stopped (fillers), their lines are theirs as a group; where one was (a burst of
targets), none can be told apart, and they stay unknown with every line that is not matched: other
traffic, and the verdicts say so. The window is read on the log's clock as the lines that do name
ledger ids place it; with none, as the recorder's (a log in another zone, with every id renamed, matches
nothing: say --engine-log-tz).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from cancelwatch.analysis.bounds import MATCH_SLACK_S
from cancelwatch.runstore.reader import Run



class AddedLine(NamedTuple):
    target: str | None
    client_id: str | None  # the id the source read back from the engine's
    engine_id: str | None
    stamp: float  # s since the run started, on the log's own clock
    resolution: float


def ledger_id(client_id: str | None, engine_request_id: str | None, known: set[str]) -> str | None:
    """The ledger's id for an engine log line. The source reads the client id back by stripping the
    suffixes vLLM adds, but a client id may itself end like one (the driver's end in 8 hex, as vLLM's
    chat suffix from 0.14 on does): where that reading is not in the ledger, the longest ledger id the
    engine's id starts with is the one."""
    if client_id in known or not engine_request_id:
        return client_id
    rest = engine_request_id.split("_", 1)[1] if engine_request_id[:1].isdigit() and "_" in engine_request_id \
        else engine_request_id
    rest = rest.split("-", 1)[1] if rest.startswith(("chatcmpl-", "cmpl-")) else rest
    parts = rest.split("-")
    for i in range(len(parts), 0, -1):
        if "-".join(parts[:i]) in known:
            return "-".join(parts[:i])
    return client_id


class LogIds:
    """Log line -> ledger id: by the id the line names, else (a gateway renamed the request) by the one
    to one match of when it entered. `bounds`: ledger id -> (send, first token or else close), s since
    the run started, on the recorder's clock: a log whose every id is renamed places no clock of its own."""

    def __init__(self, run: Run, lines: list[AddedLine], bounds: dict | None = None):
        ledger = run.ledger
        self.known: set[str] = set(ledger["request_id"]) if not ledger.empty else set()
        # requests the client stopped: their line must be theirs alone, never one of a group's
        self.stopped: set[str] = set(self.known) if "cancel_mono_ns" not in ledger.columns else \
            set(ledger["request_id"].to_numpy(dtype=object)[ledger["cancel_mono_ns"].notna().to_numpy()])
        # (target, the id the line names) -> ledger id, for lines matched by when they entered
        self.matched: dict[tuple[str | None, str | None], str] = {}
        self.grouped: set[str] = set()  # ledger ids matched as one of a group sent together (fillers)
        # (target, ledger id) -> the unknown lines inside its window, for requests no line names
        self.window: dict[tuple[str | None, str], set] = {}
        if bounds and lines:
            self._match(lines, bounds)
        self.renamed = {(tgt, rid): cid for (tgt, cid), rid in self.matched.items() if rid not in self.grouped}

    def of(self, target: str | None, client_id: str | None, engine_id: str | None) -> str | None:
        direct = ledger_id(client_id, engine_id, self.known)
        if direct in self.known:
            return direct
        return self.matched.get((target, client_id), direct)

    def renamed_as(self, target: str | None, rid: str) -> str | None:
        """The id the engine's log names ledger request `rid` by, where it was matched by time."""
        return self.renamed.get((target, rid))

    def untold(self, target: str | None, rid: str) -> int:
        """How many unknown lines, none matched, fall in the window of `rid`, which no line names: its
        line may be any of them (requests sent together through a gateway that renames them)."""
        if rid in self.matched.values():
            return 0
        return len(self.window.get((target, rid), set()) - set(self.matched))

    def _match(self, lines: list[AddedLine], bounds: dict) -> None:
        """Per target whose log names no ledger id at all (a gateway renames every request, or none): the
        one to one match, kept only where it is whole: every unknown line of the run's span inside some
        request's window (matched, or one of a few that requests sent together share). A
        log that names some ledger ids has no gateway renaming on its path: its unknown lines are other
        traffic, and one of them inside the window of a request that never reached the engine is not its
        line. A clock off by a fraction of a second shifts lines into their neighbours' windows: some are
        then left over, and the target matches nothing."""
        direct = {ledger_id(line.client_id, line.engine_id, self.known) for line in lines} & self.known
        renamed_targets = {line.target for line in lines} - {
            line.target for line in lines if ledger_id(line.client_id, line.engine_id, self.known) in self.known}
        lo = min(send for send, _ in bounds.values()) - 1.0
        hi = max(end for _, end in bounds.values()) + 1.0
        for tgt in sorted(renamed_targets, key=str):
            entered: dict[tuple[str | None, str | None], float] = {}  # unknown line -> its first instant
            for line in lines:
                if line.target == tgt:
                    key = (tgt, line.client_id)
                    entered[key] = min(entered.get(key, line.stamp), line.stamp)
            r = max([max(line.resolution, 0.001) for line in lines if line.target == tgt])
            # the ledger requests no target's log names, and the unknown lines inside each one's window
            window = {(tgt, rid): {k for k, at in entered.items() if send - r - MATCH_SLACK_S <= at <= end + MATCH_SLACK_S}
                      for rid, (send, end) in bounds.items() if rid not in direct}
            before = dict(self.matched)
            self._one_to_one(window)
            self._match_groups(window, entered, bounds)
            held = set().union(*window.values()) if window else set()
            left = [k for k, at in entered.items() if lo <= at <= hi and k not in self.matched and k not in held]
            if left:
                self.matched = before  # not whole: a line in no request's window (a clock off, or other traffic)
                self.grouped &= set(before.values())
            self.window.update(window)

    def _one_to_one(self, window: dict) -> None:
        """A request with one candidate line left takes it, unless another request has that same line as
        its only one too (then neither can be told); repeated, since a request that reached the engine
        has its line: a request with two candidates loses the one another request must have."""
        changed = True
        while changed:
            changed = False
            free = {key: cands - set(self.matched) for key, cands in window.items()
                    if key[1] not in self.matched.values()}
            only = Counter(next(iter(c)) for c in free.values() if len(c) == 1)
            for (tgt, rid), cands in free.items():
                if len(cands) == 1 and only[next(iter(cands))] == 1 and next(iter(cands)) not in self.matched:
                    self.matched[next(iter(cands))] = rid
                    changed = True

    def _match_groups(self, window: dict, entered: dict, bounds: dict) -> None:
        """Requests sent together (the fillers of a queued scenario) share their windows, and no line can
        be told to be one's rather than another's. Where none of them was stopped, which is which does not
        matter to any verdict, only that the lines are the run's: a group of k requests whose windows all
        hold the same k unmatched lines and no others takes them, in the order of their sends."""
        free = {key: frozenset(c - set(self.matched)) for key, c in window.items()
                if key[1] not in self.matched.values()}
        groups: dict[frozenset, list] = {}
        for key, cands in free.items():
            if cands:
                groups.setdefault(cands, []).append(key)
        for cands, keys in groups.items():
            held = [k for k, c in free.items() if c & cands]
            if len(keys) != len(cands) or len(held) != len(keys) or any(rid in self.stopped for _, rid in keys):
                continue  # another request shares some of them, or a stopped one is among them: untold
            for (_, rid), line in zip(sorted(keys, key=lambda k: bounds[k[1]][0]), sorted(cands, key=entered.get)):
                self.matched[line] = rid
                self.grouped.add(rid)
