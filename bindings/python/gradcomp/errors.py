"""The errors of a failed step (torch-free; re-exported as ``gradcomp.CollectiveError`` and
``gradcomp.RankMismatchError``).

A compressed allreduce fails as a whole: when a collective of a step fails (a peer died, a
timeout, a closed connection), when ranks disagree on what they reduce, or when a decode fails,
the Future of every call of that step raises on every surviving rank and the state the step
changed (residuals, PowerSGD's Qs, step counters) is put back as it was before the step (the
README: "When a step fails"). The codec errors (``gradcomp.InvalidArgumentError``,
``gradcomp.CorruptPacketError``) keep their types; a collective's own error (torch.distributed's
``RuntimeError`` / ``DistBackendError``) becomes the ``__cause__`` of a :class:`CollectiveError`.
"""


class CollectiveError(RuntimeError):
    """A collective of a compressed allreduce failed, or the step it belongs to failed elsewhere.

    The message names the scheme, the tensor or bucket, the step and the collective that failed,
    followed by torch.distributed's own message (also in ``__cause__``). Raised by ``wait()`` /
    ``value()`` of the Future a scheme, :class:`gradcomp.torch.Compressor`, the DDP hooks, the
    DeepSpeed backend or a ``gradcomp.optim`` optimizer returns, or at once by a collective issued
    in the calling thread. Through ``Future.then`` chains (DDP's reducer among them) torch turns
    it into a ``RuntimeError`` carrying the same message.
    """


class RankMismatchError(CollectiveError):
    """Ranks disagree on what they reduce: another codec or spec, another numel, dtype or bucket
    layout for the same tensor or bucket, calls in another order, or a rank at another step (one
    that skipped or repeated a step). Raised on every rank, before anything is decoded into a
    gradient; the message says which rank sent what and what this rank expected."""


def in_context(e: BaseException, prefix: str) -> BaseException:
    """``e`` again with ``prefix`` before its message (``"prefix: message"``), its type kept for
    gradcomp's errors and the builtin ValueError / TypeError / RuntimeError (anything else becomes
    a :class:`CollectiveError`); ``e`` is its ``__cause__``. BaseExceptions that are not
    Exceptions (KeyboardInterrupt) are returned unchanged."""
    if not isinstance(e, Exception):
        return e
    msg = f"{prefix}: {e}"
    cls = type(e)
    new: BaseException
    if isinstance(e, CollectiveError) or cls.__module__.startswith("gradcomp") or cls in (ValueError, TypeError,
                                                                                          RuntimeError):
        try:
            new = cls(msg)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            new = CollectiveError(msg)
    else:
        new = CollectiveError(msg)
    new.__cause__ = e
    return new


__all__ = ["CollectiveError", "RankMismatchError", "in_context"]
