"""Reports of one multi-process operation (a save, an export) through the key-value store.

Each process reports under the operation's namespace; process 0 gathers the reports and
publishes the outcome; the others wait for it. The namespace is the same on every process
without talking, because every process performs the operations on a location in the same
order: the n-th save to a location is named by n.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..errors import CoordinationError
from .base import Coordinator

log = logging.getLogger("snapshard")

# How long a process waits for the others in a save, an export or a manager's start-up.
DEFAULT_TIMEOUT_S = 600.0

_counts: dict[str, int] = {}
_counts_lock = threading.Lock()


def namespace(kind: str, location: str) -> str:
    """`snapshard/<kind>/<location hash>/<n>` for the n-th operation of this kind there."""
    with _counts_lock:
        n = _counts.get(kind + location, 0)
        _counts[kind + location] = n + 1
    return f"snapshard/{kind}/{hashlib.sha256(location.encode()).hexdigest()[:16]}/{n}"


# The reports process 0 gathers (see Rendezvous.report_own), and what an operation's
# namespace may still hold once every process has read its outcome: a gather that found
# every report can return before the last reporter's count and signal are in.
_GATHERED = ("written", "ok", "v")
_LEFT_AFTER_OUTCOME = ["outcome", "seen", "ready"] + [
    f"{key}/{mark}" for key in _GATHERED for mark in ("count", "complete")
]
# How long process 0 waits on the signal before it lists the reports again: the signal
# is missing only where a process died between its report and its count.
_RELIST_S = 1.0


_relay_classes: dict[str, type[CoordinationError]] = {}


def _report_doc(error: BaseException | None) -> dict[str, Any]:
    """A process's report of its part: whether it succeeded, and its failure as the
    others raise it (`relayed_error`)."""
    return {
        "ok": error is None,
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "error_type": None if error is None else type(error).__name__,
        # what a failure tells the other processes beyond its text (see `relay`)
        "relay": getattr(error, "relay", None),
    }


def relayed_error(context: str, doc: dict[str, Any]) -> CoordinationError:
    """Another process's failure (its report or outcome `doc`), raised here: a
    CoordinationError that is also of the failure's own class where that is one of
    snapshard's errors, so that every process raises the same type for one failure (an
    `except CheckpointExistsError` catches it on every process, not only where it arose).
    Its `relay` is the failure's own `relay` attribute, where it had one: a small JSON
    value for the processes that can say more (a tree check names the leaves of the
    process whose tree differs, which only that process knows)."""
    message = f"{context}: {doc['error']}"
    cls = _relay_class(str(doc.get("error_type") or ""))
    try:
        out = cls(message)
    except TypeError:  # a class whose constructor takes more than a message
        out = CoordinationError(message)
    out.relay = doc.get("relay")  # type: ignore[attr-defined]
    return out


def _relay_class(name: str) -> type[CoordinationError]:
    """The class a failure of class `name` is raised as elsewhere (see relayed_error): made
    once per name, and pickled by name (another process makes it again)."""
    cls = _relay_classes.get(name)
    if cls is None:
        cause = getattr(errors, name, None)
        cls = CoordinationError
        if (
            isinstance(cause, type)
            and issubclass(cause, errors.SnapshardError)
            and not issubclass(CoordinationError, cause)  # (SnapshardError itself, or one above)
            and not issubclass(cause, CoordinationError)
        ):
            body = {"__module__": errors.__name__, "__reduce__": _reduce_relayed}
            cls = type(name, (cause, CoordinationError), body)
        _relay_classes[name] = cls
    return cls


def _reduce_relayed(error: CoordinationError) -> tuple[Any, ...]:
    return (_relayed_again, (type(error).__name__, error.args, errors.error_fields(error)))


def _relayed_again(name: str, args: tuple[Any, ...], fields: dict[str, Any]) -> Any:
    """A relayed error unpickled: of the same made class, in this process."""
    return errors.rebuild_error(_relay_class(name), args, fields)


@dataclass
class Rendezvous:
    """One multi-process operation's keys in the coordinator's key-value store: each
    process `report`s under `prefix`, process 0 `gather`s the reports and
    `publish_outcome`s, the others `await_outcome`; every wait gives up at `deadline`
    (`start_clock`), naming the process it waited for and the operation (`what`)."""

    coord: Coordinator
    prefix: str
    what: str  # how errors name the operation, e.g. "save to /ckpt/100"
    timeout_s: float
    deadline: float = math.inf

    def sub(self, key: str) -> Rendezvous:
        """A rendezvous for one step of this operation, under its own keys."""
        return Rendezvous(self.coord, f"{self.prefix}/{key}", self.what, self.timeout_s)

    def start_clock(self) -> None:
        """Waits from now on give up `timeout_s` seconds from now."""
        self.deadline = time.monotonic() + self.timeout_s

    def _left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    def report(self, key: str, error: BaseException | None = None, **payload: Any) -> None:
        self.coord.set(f"{self.prefix}/{key}", json.dumps({**_report_doc(error), **payload}))

    def report_own(self, key: str, error: BaseException | None = None, **payload: Any) -> None:
        """This process's report `key/<pid>`, for process 0's `gather(key)`. A process other
        than 0 then counts itself in `key/count`; the report that completes the set, and any
        failure, sets `key/complete`, on which process 0 waits (inside the store, where it
        can block) rather than polling: its wake-up follows the last report by one request,
        not by the pause of a poll that grew while it waited (up to 100 ms)."""
        me = self.coord.process_index
        self.report(f"{key}/{me}", error, **payload)
        if me == 0:
            return
        count = self.coord.increment(f"{self.prefix}/{key}/count")
        if error is not None or count >= self.coord.process_count - 1:
            self.coord.set(f"{self.prefix}/{key}/complete", "1")

    def _get(self, key: str, who: str) -> dict[str, Any]:
        try:
            return dict(json.loads(self.coord.get(f"{self.prefix}/{key}", self._left())))
        except TimeoutError:
            raise CoordinationError(
                f"{self.what}: {who} did not report within {self.timeout_s:g} s"
            ) from None

    def wait(self, key: str, who: str) -> dict[str, Any]:
        """The report at `key`; raises naming `who` when it failed or did not come in time."""
        doc = self._get(key, who)
        if not doc["ok"]:
            raise relayed_error(f"{self.what}: {who} failed", doc)
        return doc

    def gather(self, key: str) -> dict[int, dict[str, Any]]:
        """Process 0: every other process's report `key/<pid>` (`report_own`); a failure or
        a process that does not report in time raises, naming it (and every process still
        missing).

        The reports are read together (one listing of `key/`, never one request per
        process) when the last of them or a failure has set `key/complete`, which process 0
        waits for; it lists them again every `_RELIST_S` regardless, so that a process that
        died between its report and its count costs that much, not the timeout. A signal
        found set while a report is still missing (which the protocol never leaves) makes
        the listings a second apart rather than a spin on the store. They are deleted once
        read."""
        # its count and signal outlive the outcome: they are cleaned by that list
        assert key in _GATHERED, f"gather({key!r}): add {key!r} to _GATHERED"
        me, n = self.coord.process_index, self.coord.process_count
        want = set(range(n)) - {me}
        signal = f"{self.prefix}/{key}/complete"
        signalled = False
        try:
            while True:
                got = self._reports(key)
                for p, doc in sorted(got.items()):
                    if p in want and not doc["ok"]:
                        raise relayed_error(f"{self.what}: process {p} failed", doc)
                if want <= got.keys():
                    return {p: got[p] for p in sorted(want)}
                left = self.deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(want - got.keys())
                    raise CoordinationError(
                        f"{self.what}: process(es) {missing} did not report within "
                        f"{self.timeout_s:g} s (stopped or died)"
                    )
                if signalled:
                    time.sleep(min(left, _RELIST_S))
                    continue
                with contextlib.suppress(TimeoutError):
                    self.coord.get(signal, min(left, _RELIST_S))
                    signalled = True
        finally:
            self._forget(f"{self.prefix}/{key}", [str(p) for p in range(n)])

    def _reports(self, key: str) -> dict[int, dict[str, Any]]:
        out = {}
        for rel, text in self.coord.get_dir(f"{self.prefix}/{key}").items():
            if rel.isdigit():
                out[int(rel)] = dict(json.loads(text))
        return out

    def _forget(self, prefix: str, keys: list[str] | None = None) -> None:
        """Delete keys nobody reads any more (best effort: a leftover key is harmless);
        `keys` as in Coordinator.delete."""
        try:
            self.coord.delete(prefix, keys)
        except Exception as e:
            log.debug("could not delete coordination keys %s: %s", prefix, e)

    def publish_outcome(self, error: BaseException | None = None, **payload: Any) -> None:
        if self.coord.process_count == 1:
            self._forget(self.prefix)  # nobody waits for it
            return
        self.report("outcome", error, **payload)

    def failed_outcome(self) -> CoordinationError | None:
        """Process 0's failure of the operation, if it has published one (no waiting)."""
        text = self.coord.try_get(f"{self.prefix}/outcome")
        doc = json.loads(text) if text is not None else None
        return relayed_error(f"{self.what} failed", doc) if doc and not doc["ok"] else None

    def await_outcome(self) -> dict[str, Any]:
        """The others: wait for process 0's outcome (returned, with its payload), raising
        it if the operation failed. The last process to read it deletes the keys."""
        doc = self._get("outcome", "process 0")
        try:
            if self.coord.increment(f"{self.prefix}/seen") == self.coord.process_count - 1:
                # (the reports are gone: process 0 deleted them as it gathered them)
                self._forget(self.prefix, _LEFT_AFTER_OUTCOME)
        except CoordinationError:
            pass
        if not doc["ok"]:
            raise relayed_error(f"{self.what} failed", doc)
        return doc


def write_then_commit(
    rv: Rendezvous,
    write: Callable[[], dict[str, Any]],
    commit: Callable[[list[dict[str, Any]]], None],
    discard: Callable[[], None],
    discard_own: Callable[[bool], None] | None = None,
) -> dict[str, Any]:
    """The protocol of every multi-process operation (saves, exports), in one place.

    Every process runs `write` and reports its result (a small JSON document) or its error
    under `written/<pid>`; process 0 gathers every report, in process order, and runs
    `commit` on them; it publishes the outcome, which the others wait for. Any failure is
    raised on every process, naming the process that failed; process 0 then runs `discard`
    (nothing was made visible), and every other process `discard_own(settled)`, which
    removes what it wrote itself (process 0's `discard` may have run before this process
    wrote, and another process's files may still be in the making); `settled`: process 0
    has failed the operation, so what is left of the staging area may go once empty. A
    process whose write fails after process 0 failed the operation (its staging area
    removed under it) raises process 0's error, the cause. The failure is raised, not
    logged: whoever runs the operation decides (a background save logs it once). Returns
    this process's report.
    """
    pid = rv.coord.process_index

    def fail(e: BaseException) -> None:
        rv.publish_outcome(e)
        discard()

    try:
        mine = write()
    except BaseException as e:
        cause = report_failure(rv, e)
        if rv.coord.is_leader:
            discard()
            raise
        if discard_own is not None:
            discard_own(cause is not None)
        if cause is not None:
            raise cause from e
        raise
    rv.report_own("written", **mine)
    rv.start_clock()
    if rv.coord.is_leader:
        try:
            others = rv.gather("written")
            commit([mine if p == pid else others[p] for p in range(rv.coord.process_count)])
        except BaseException as e:
            fail(e)
            raise
        rv.publish_outcome()
    else:
        try:
            rv.await_outcome()
        except BaseException:
            if discard_own is not None:
                discard_own(True)
            raise
    return mine


def report_failure(rv: Rendezvous, error: BaseException) -> CoordinationError | None:
    """This process's part of a `write_then_commit` operation failed (or failed before it
    began: a bad leaf in a save's blocking phase): report it where the others look, so that
    they fail within a poll, naming it, instead of waiting for the timeout; process 0
    publishes it as the outcome. Returns process 0's failure of the operation where it was
    published before this report (then `error` may be only its consequence: the staging
    area removed under this process), to be raised instead. It is read before reporting:
    read after, it may be process 0's relay of this very failure, and the process that
    failed would raise the others' account of its error instead of its own. Best effort:
    where the store itself failed, the caller's own error is what it must see."""
    try:
        cause = None if rv.coord.is_leader else rv.failed_outcome()
        rv.report_own("written", error)
        if rv.coord.is_leader:
            rv.publish_outcome(error)
        return cause
    except Exception as e:
        log.debug("%s: could not report the failure to the other processes: %s", rv.what, e)
        return None


def all_succeeded(rv: Rendezvous, step: str, error: BaseException | None) -> None:
    """Every process learns whether every process's part of `step` succeeded (`error`: this
    process's failure, or None); raises on all of them, naming the failing process, when
    one did not. Process 0 gathers the reports and publishes the outcome. A step of reads
    before the processes exchange what they read (read-once restores) uses it, so that a
    failed read fails every process in bounded time instead of leaving them waiting."""
    coord = rv.coord
    me = coord.process_index
    sub = rv.sub(step)
    sub.start_clock()
    if me != 0:
        sub.report_own("ok", error)
        sub.await_outcome()  # raises the outcome's error, naming the failing process
        return
    failure: CoordinationError | None = None
    if error is not None:  # (of its own class, as the others raise it)
        failure = relayed_error(f"{rv.what}: process 0 failed", _report_doc(error))
    else:
        try:
            sub.gather("ok")
        except CoordinationError as e:
            failure = e
    sub.publish_outcome(failure)
    if failure is not None:
        raise failure from error


def on_every_process(rv: Rendezvous, value: bool) -> bool:
    """Whether `value` is true on every process, for a choice that each process could make
    from what it alone sees but that all must make alike."""
    return _decided(rv, value, lambda mine, others: mine and all(others))


def same_on_every_process(
    rv: Rendezvous, value: str | None, error: BaseException | None = None
) -> bool:
    """Whether every process holds the same `value`, and it is not None: e.g. the name of
    what one earlier collective made, which every process must still hold to use it.
    `error`: this process failed before it could say (every process raises it)."""

    def same(mine: str | None, others: list[Any]) -> bool:
        return mine is not None and all(v == mine for v in others)

    return _decided(rv, value, same, error)


def _decided(
    rv: Rendezvous,
    value: Any,
    decide: Callable[[Any, list[Any]], bool],
    error: BaseException | None = None,
) -> bool:
    """One report each; process 0 gathers them, decides from its value and the others'
    (in process order) and publishes the answer (or, if a process failed, `error` where it
    reported one, or did not report in time, the error naming it, raised on every
    process; a process that failed raises its own `error`)."""
    coord = rv.coord
    if coord.process_count == 1:
        if error is not None:
            raise error
        return decide(value, [])
    rv.start_clock()
    if coord.process_index != 0:
        if error is not None:
            rv.report_own("v", error)
            with contextlib.suppress(CoordinationError):
                rv.await_outcome()  # (its keys are cleaned by the last to read them)
            raise error
        rv.report_own("v", value=value)
        return bool(rv.await_outcome()["value"])
    if error is not None:  # (the others' reports are not waited for)
        rv.publish_outcome(error)
        raise error
    try:
        answer = decide(value, [doc["value"] for doc in rv.gather("v").values()])
    except CoordinationError as e:
        rv.publish_outcome(e)
        raise
    rv.publish_outcome(value=answer)
    return answer
