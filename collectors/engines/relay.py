"""The cancel relay: how an app should pass a user's "stop" on to an in-process engine.

Importable on its own (standard library only) as an example for app authors. It keeps this contract:
- a registry maps the app's request id to the engine request id, its owner and the task serving it;
- a cancel checks the owner before acting;
- a cancel that arrives before its request is registered is kept, and the request is then never
  started (with `early_cancel="reject"` the cancel is answered `rejected_unknown`, and the request is
  still never started: a client told "rejected" that sees its request run anyway was lied to);
- with several replicas, the replica is part of the id it issues (`<replica>-<hex>`): a cancel for
  another replica's id is answered `not_here`, never kept as an early cancel nor answered as accepted
  (relay_app passes it on to that replica when it knows where it is);
- every cancel, whatever its outcome (cancelled, duplicate, rejected, early, not here), is logged in
  arrival order with its id, owner and outcome (logger `cancelwatch.relay`, INFO);
- completion and cancel race through one terminal transition: whichever comes first wins;
- the `finally` path of a stream awaits `abort()` and then closes the engine's iterator, in nested
  try/finally so the iterator is closed even when the abort raises or is cancelled. Both run in a
  task of their own: under Starlette/anyio a client that goes away cancels every later await of the
  serving task, and the engine must still be told;
- an abort that fails or hangs is retried a bounded number of times, each attempt bounded in time,
  with a logged alert (`abort_worst_case_s` bounds them all);
- the relay never says a request was released: vLLM's abort() acknowledges nothing. Its word is that the
  abort was sent (`abort`: `sent`, `failed`, or `unconfirmed`); release is for the scheduler's evidence
  to show. A retry that returned after an attempt that hung may be hollow (the front end may already have
  dropped its state while the engine core still holds the request): it is `sent` only once the app's own
  scheduler gauges (`scheduler_count`) fall below their count at the first attempt, otherwise
  `unconfirmed`, with an alert (no gauges: it cannot tell, and says so);
- CancelledError is never swallowed: the serving task still sees its cancellation;
- a duplicate cancel is idempotent and touches no other request;
- a cancelled request is never retried automatically; request ids come from the app (`issue_id`),
  never from the client, so an id is never served twice;
- finished entries and the tombstones of early cancels are pruned after `keep_s` (and beyond
  `max_entries`), so the registry's memory is bounded.

`generate(engine_request_id, payload)` must return an async iterator of outputs (vLLM:
`AsyncLLM.generate`), and `abort(engine_request_id)` a coroutine (vLLM: `AsyncLLM.abort`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("cancelwatch.relay")

TERMINAL = ("completed", "cancelled", "error")


class RelayError(Exception):
    pass


class RequestCancelled(RelayError):
    """The request was cancelled (possibly before it started) and will not run."""


class AlreadyRan(RelayError):
    """The request id has been served before; a cancelled request is never retried automatically."""


@dataclass
class Entry:
    request_id: str
    owner: str
    engine_request_id: str
    task: asyncio.Task | None = None
    state: str = "running"  # running -> completed | cancelled | error
    registered_ns: int = field(default_factory=time.monotonic_ns)
    finished_ns: int | None = None
    app_received_ns: int | None = None
    engine_abort_ns: int | None = None
    abort_attempts: int = 0
    abort_ok: bool | None = None  # None: no abort needed (completed) or not yet tried
    abort_unconfirmed: bool = False  # abort() returned on a retry the scheduler's gauges did not bear out
    outputs: int = 0

    @property
    def abort(self) -> str | None:
        """What the relay can say of the engine's side: `sent` (abort() returned), `unconfirmed` (it returned
        on a retry the scheduler's gauges did not bear out), `failed` (every attempt failed); None while no
        abort was needed or it is under way. Never "released": that is for the scheduler's evidence."""
        if self.abort_ok is None:
            return None
        if not self.abort_ok:
            return "failed"
        return "unconfirmed" if self.abort_unconfirmed else "sent"


class Relay:
    def __init__(self, generate, abort, *, max_abort_attempts: int = 3, abort_retry_s: float = 0.05,
                 abort_timeout_s: float = 2.0, early_cancel: str = "keep", on_event=None, keep_s: float = 300.0,
                 max_entries: int = 10_000, replica: str | None = None, scheduler_count=None,
                 confirm_s: float = 5.0):
        if early_cancel not in ("keep", "reject"):
            raise ValueError("early_cancel must be 'keep' or 'reject'")
        if replica is not None and (not replica or "-" in replica):
            raise ValueError("replica must be a non-empty name without '-'")
        self.replica = replica
        # () -> the scheduler's running + waiting requests now (the app's own gauges), or None: unknown
        self.scheduler_count = scheduler_count
        self.confirm_s = confirm_s
        self._generate = generate
        self._abort = abort
        self.max_abort_attempts = max_abort_attempts
        self.abort_retry_s = abort_retry_s
        self.abort_timeout_s = abort_timeout_s
        self.early_cancel = early_cancel
        self.on_event = on_event or (lambda kind, entry, **data: None)
        self.keep_s = keep_s
        self.max_entries = max_entries
        self.entries: dict[str, Entry] = {}
        self.early: dict[str, tuple[str, int]] = {}  # request id -> (owner, when) of a cancel that came first
        self._releases: set[asyncio.Task] = set()  # aborts under way, held until they end

    def issue_id(self) -> str:
        """A fresh request id for the app to hand to its client (never taken from the client); with a
        replica name, `<replica>-<hex>`: any replica can tell whose it is."""
        return f"{self.replica}-{uuid.uuid4().hex}" if self.replica else uuid.uuid4().hex

    @staticmethod
    def replica_of(request_id: str) -> str | None:
        """The replica an id was issued by (None: an id without one)."""
        head, sep, _ = request_id.partition("-")
        return head if sep else None

    @property
    def abort_worst_case_s(self) -> float:
        """The longest the abort of one request can take: every attempt timing out, with the pause after
        each failed one, and the wait for the scheduler to confirm a retry (what /cancel waits for)."""
        return sum(self.abort_timeout_s + self.abort_retry_s * a for a in range(1, self.max_abort_attempts + 1)) \
            + (self.confirm_s if self.scheduler_count is not None else 0.0)

    def prune(self, now_ns: int | None = None) -> None:
        """Forget finished entries and early-cancel tombstones older than `keep_s`, and the oldest of
        them beyond `max_entries`; requests still running are never forgotten."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        horizon = now_ns - int(self.keep_s * 1e9)
        done = sorted((e.finished_ns, rid) for rid, e in self.entries.items() if e.finished_ns is not None)
        excess = max(0, len(self.entries) - self.max_entries)
        for i, (finished_ns, rid) in enumerate(done):
            if finished_ns < horizon or i < excess:
                del self.entries[rid]
        tombs = sorted((at, rid) for rid, (_, at) in self.early.items())
        excess = max(0, len(tombs) - self.max_entries)
        for i, (at, rid) in enumerate(tombs):
            if at < horizon or i < excess:
                del self.early[rid]

    # ------------------------------------------------------------------ the one terminal transition
    def _finish(self, entry: Entry, state: str) -> bool:
        """Move to a terminal state once; False when another transition already won."""
        if entry.state in TERMINAL:
            return False
        entry.state = state
        entry.finished_ns = time.monotonic_ns()
        self.on_event(state, entry)
        return True

    # ------------------------------------------------------------------ serving
    async def stream(self, request_id: str, owner: str, payload):
        """Serve one request: yields the engine's outputs until it completes or is cancelled."""
        self.prune()
        prior = self.entries.get(request_id)
        if prior is not None:
            if prior.state == "cancelled":
                raise RequestCancelled(f"{request_id} was cancelled; a cancelled request is not retried")
            raise AlreadyRan(f"{request_id} has already been served")
        early_owner = self.early.pop(request_id, (None, 0))[0]
        entry = Entry(request_id, owner, f"{request_id}-{uuid.uuid4().hex[:8]}", task=asyncio.current_task())
        self.entries[request_id] = entry
        if early_owner == owner:
            entry.app_received_ns = time.monotonic_ns()
            self._finish(entry, "cancelled")  # nothing reached the engine: no abort to send (abort None)
            raise RequestCancelled(f"{request_id} was cancelled before it started")
        outputs = self._generate(entry.engine_request_id, payload)
        completed = False
        try:
            async for out in outputs:
                entry.outputs += 1
                if getattr(out, "finished", False):
                    completed = self._finish(entry, "completed")
                yield out
                if entry.state == "cancelled":
                    break  # a cancel won while the consumer held this output
            else:
                completed = completed or self._finish(entry, "completed")
        except Exception:
            self._finish(entry, "error")
            raise
        finally:
            # cancelled, failed, or the consumer went away: the engine must drop the request. Started
            # before the first await here, in a task of its own, so a cancellation that hits every
            # await of this task (anyio) cannot stop it; awaited through a shield, so this task still
            # waits for it when it can and still sees its own cancellation when it comes
            if not completed:
                self._finish(entry, "cancelled")
            release = asyncio.ensure_future(self._release(entry, outputs, abort=not completed))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)
            await asyncio.shield(release)

    async def _release(self, entry: Entry, outputs, abort: bool) -> None:
        try:
            if abort:
                await self._abort_with_retries(entry)
        finally:
            await _aclose(outputs)

    async def _abort_with_retries(self, entry: Entry) -> bool:
        last = None
        count_at_first = self._count()
        timed_out = False  # an attempt that hung may have done half its work (the front end, not the core)
        for attempt in range(1, self.max_abort_attempts + 1):
            entry.abort_attempts = attempt
            try:
                await asyncio.wait_for(self._abort(entry.engine_request_id), self.abort_timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure (a hang included) is retried, then alerted
                timed_out = timed_out or isinstance(exc, TimeoutError)
                last = exc if not isinstance(exc, TimeoutError) else TimeoutError(
                    f"no answer within {self.abort_timeout_s:g} s")
                log.warning("abort of %s failed (attempt %d/%d): %s", entry.engine_request_id, attempt,
                            self.max_abort_attempts, last)
                await asyncio.sleep(self.abort_retry_s * attempt)
                continue
            entry.engine_abort_ns = time.monotonic_ns()
            if timed_out and not await self._scheduler_let_go(count_at_first):
                entry.abort_unconfirmed = True
                log.error("ALERT: abort of %s returned on attempt %d, but the scheduler's gauges do not show it "
                          "gone (count at the first attempt: %s): the engine may still hold it",
                          entry.engine_request_id, attempt, count_at_first)
            entry.abort_ok = True
            self.on_event("abort_returned", entry, attempts=attempt)
            return True
        entry.abort_ok = False
        log.error("ALERT: abort of %s failed %d times (%s): the engine may still hold it",
                  entry.engine_request_id, self.max_abort_attempts, last)
        self.on_event("abort_failed", entry, error=str(last))
        return False

    def _count(self) -> float | None:
        try:
            return None if self.scheduler_count is None else self.scheduler_count()
        except Exception:  # noqa: BLE001 - gauges that cannot be read say nothing
            return None

    async def _scheduler_let_go(self, count_at_first: float | None) -> bool:
        """After an abort that returned on a retry behind one that hung: whether the scheduler's count fell below the one at the first attempt
        within `confirm_s` (other requests ending count too: it bears the abort out, it cannot prove it;
        no gauges, or no fall: not borne out)."""
        if count_at_first is None:
            return False
        deadline = time.monotonic() + self.confirm_s
        while True:
            now = self._count()
            if now is not None and now < count_at_first:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ cancelling
    async def cancel(self, request_id: str, owner: str) -> str:
        """Cancel on behalf of `owner`. Returns what happened; never touches another request. Logged, in
        the order the cancels arrive, whatever the outcome."""
        outcome = self._cancel(request_id, owner)
        log.info("cancel %s from %s: %s", request_id, owner, outcome)
        return outcome

    def _cancel(self, request_id: str, owner: str) -> str:
        self.prune()
        entry = self.entries.get(request_id)
        if entry is None:
            home = self.replica_of(request_id)
            if self.replica is not None and home != self.replica:
                return "not_here"  # another replica's request (or no replica's): not ours to keep or refuse
            if request_id in self.early and self.early[request_id][0] != owner:
                return "rejected_not_owner"
            # kept either way: the request must never start once its client asked to stop it
            self.early.setdefault(request_id, (owner, time.monotonic_ns()))
            return "rejected_unknown" if self.early_cancel == "reject" else "kept_until_registered"
        if entry.owner != owner:
            return "rejected_not_owner"
        if entry.app_received_ns is None:
            entry.app_received_ns = time.monotonic_ns()
        if not self._finish(entry, "cancelled"):
            return f"already_{entry.state}"
        task = entry.task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
        return "cancelled"

    def status(self, request_id: str) -> dict | None:
        e = self.entries.get(request_id)
        if e is None:
            return None
        return {"request_id": e.request_id, "engine_request_id": e.engine_request_id, "owner": e.owner,
                "state": e.state, "abort": e.abort, "abort_ok": e.abort_ok, "abort_attempts": e.abort_attempts,
                "app_received_ns": e.app_received_ns, "engine_abort_ns": e.engine_abort_ns,
                "outputs": e.outputs}


async def _aclose(it) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:
            await close()
        except RuntimeError:  # already running or closed elsewhere; a cancellation goes on up
            pass
