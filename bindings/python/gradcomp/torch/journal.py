"""The undo log of a step, so that a failed step loses nothing (the README: "When a step fails").

A step of a compressor (:class:`gradcomp.torch.Compressor`, PowerSGD's engine) changes state
before its collectives complete: an encode updates the worker residual in place, two_phase's
second encode the server residual, a dense call flushes residuals into the gradient, PowerSGD
overwrites its Qs, the step counter advances at the step's last call. When any call of the step
fails (a collective, a mismatch between ranks, a decode), every change of that step is undone,
so the state -- and a checkpoint written after the failure -- is what it was before the step.

An :class:`Attempt` is one try of one step: opened by the step's first call, closed by the
engine's ``end_step``. Each call registers how to undo what it changed (:meth:`Attempt.on_undo`)
before it changes it; the first failure (:meth:`Attempt.fail`) runs every registered undo once,
under the journal's lock, and marks the attempt failed: calls of it that complete later undo
themselves and raise too, and ``end_step`` does not advance the step counter. When the failure
lands after ``end_step`` (the DDP hook ends a step at its last bucket, before the collectives
complete), the counter is put back, unless a later step has begun (then a warning says the
failure could not be undone: wait for a step's Futures before starting the next, as DDP does).

State changes that move mass without changing it (a layout change folding a server residual, a
loss-scale change rescaling the residuals) are not undone: the residuals after a failed step
then equal the ones before it up to where they live and the units they are kept in.
"""

import logging
import threading
from typing import Callable, List, Optional

from ..errors import CollectiveError, in_context

log = logging.getLogger("gradcomp")


class NotApplied(CollectiveError):
    """A call whose step failed in another call: its result is not applied (the step is undone);
    the message names where the step failed."""


class Attempt:
    """One try of step ``step`` (see the module docstring).

    Attributes:
        step: the engine's step counter when the attempt opened.
        failure: the first error of the attempt (None while it has none).
        where: what failed first, e.g. ``"bucket 0"``.
        closed: ``end_step`` ran for it.
        rec: the engine's stats record of this attempt (set by the engine).
        checked: whether the attempt's first call already checked the ranks' call descriptors.
    """

    __slots__ = ("journal", "step", "failure", "where", "closed", "rec", "checked", "keys", "_undo")

    def __init__(self, journal: "StepJournal", step: int):
        self.journal = journal
        self.step = int(step)
        self.failure: Optional[BaseException] = None
        self.where = ""
        self.closed = False
        self.rec = None
        self.checked = False
        self.keys: set = set()  # the tensors / buckets called in this attempt
        self._undo: List[Callable[[], None]] = []

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Register ``fn`` to run if this attempt fails (at once when it already has)."""
        with self.journal.lock:
            if self.failure is not None:
                fn()
            else:
                self._undo.append(fn)

    def fail(self, where: str, e: BaseException) -> bool:
        """Record that ``where`` failed with ``e``: the first failure undoes every registered
        change (newest first) and rewinds the engine's step counter if the step had ended.
        Returns True for the first failure of the attempt."""
        with self.journal.lock:
            if self.failure is not None:
                return False
            self.failure, self.where = e, where
            for fn in reversed(self._undo):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - undo the rest; the step's error is raised anyway
                    log.exception("gradcomp: undoing step %d after a failure in %s", self.step, where)
            self._undo = []
            self.journal._failed(self)
            return True

    @property
    def failed(self) -> bool:
        return self.failure is not None


class StepJournal:
    """The attempts of one engine (module docstring).

    Args:
        rewind: called as ``rewind(step)`` under the lock when a failure lands after its step's
            ``end_step`` and no later step has begun: the engine puts its step counter back.
    """

    def __init__(self, rewind: Callable[[int], None]):
        self.lock = threading.RLock()
        self._rewind = rewind
        self._open: Optional[Attempt] = None
        self._last: Optional[Attempt] = None

    def attempt(self, step: int, key=None) -> Attempt:
        """The attempt a call of ``key`` belongs to: the open one, or a new one for ``step`` when
        none is open -- or when the open one failed and has seen ``key`` already (the step is
        being tried again, e.g. after a failure that ended the step's calls before its last
        bucket: the failed attempt is closed without advancing the counter)."""
        with self.lock:
            a = self._open
            if a is not None and a.failed and key is not None and key in a.keys:
                a.closed = True
                self._last = a
                self._open = a = None
            if a is None:
                a = self._open = Attempt(self, step)
            if key is not None:
                a.keys.add(key)
            return a

    @property
    def current(self) -> Optional[Attempt]:
        """The open attempt, or None."""
        return self._open

    def end_step(self, advance: Callable[[], None]) -> bool:
        """Close the open attempt; ``advance()`` (the engine's step counter += 1) runs under the
        lock unless the attempt failed. Returns whether it ran."""
        with self.lock:
            a, self._open = self._open, None
            if a is not None:
                a.closed = True
                self._last = a
                if a.failed:
                    return False
            advance()
            return True

    def _failed(self, a: Attempt) -> None:
        if not a.closed:
            return
        if self._last is a and self._open is None:
            self._rewind(a.step)
        else:
            log.warning("gradcomp: step %d failed in %s after step %d began; its changes are undone but the "
                        "step counter stays (wait for every Future of a step before starting the next)",
                        a.step, a.where, self._open.step if self._open is not None else a.step + 1)


def peer_check(att: Attempt, verified: dict, key, sig, make: Callable[[bool], object],
               fail: Callable[[BaseException], BaseException], now: bool = False):
    """The ranks' call descriptors of one call (:class:`gradcomp.schemes.check.PeerCheck`, built
    by ``make(now)``): when ``key``'s call signature ``sig`` is new (a first call, a new layout,
    scheme or dtype) they are compared at once, in the calling thread, before anything is sent
    (so a mismatched numel never reaches a collective of another size) and None is returned;
    else the first call of each attempt returns the check for its scheme to run beside its
    collective (compared before the first decode); later calls of the attempt get None. ``now``
    compares at once whatever the signature (a call whose buffers were just allocated: every rank
    allocates at the same call, so they all compare there).

    Raises:
        the error ``fail(e)`` returns (the step fails) when the descriptors differ.
    """
    new = now or verified.get(key) != sig
    if not new and att.checked:
        return None
    att.checked = True
    check = make(new)
    if not new:
        return check
    try:
        check.verify()
    except Exception as e:  # noqa: BLE001 - the step fails on every rank
        raise fail(e) from e
    verified[key] = sig
    return None


def fail_call(att: Attempt, where: str, context: str, e: BaseException, stats, restored: str) -> BaseException:
    """A call of ``att`` (``where``: e.g. "bucket 0") failed with ``e``: the first failure of the
    attempt undoes the step (:meth:`Attempt.fail`), drops its stats record and logs it (``restored``
    says what was put back). Returns the error to raise: ``e`` with ``context`` before its message
    (:func:`gradcomp.errors.in_context`), or ``e`` itself when it names its step already (a
    mismatch) or is a :class:`NotApplied`."""
    if isinstance(e, NotApplied):
        return e
    if att.fail(where, e):
        stats.fail(att.rec)
        log.error("%s: failed: %s; %s put back", context, e, restored)
    if getattr(e, "step_context", False):
        return e
    return in_context(e, context)


def not_applied(att: Attempt, context: str) -> NotApplied:
    """The error of a call whose step failed in another call (``context`` names this call)."""
    return NotApplied(f"{context}: not applied: the step failed in {att.where}: {att.failure}")
