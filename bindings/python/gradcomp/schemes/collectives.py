"""Collective steps more than one scheme runs the same way.

- :func:`all_gather_failsafe`: the last all-gather of a scheme whose earlier work may have failed
  on this rank (``two_phase``'s all-gather of the re-encoded chunk sums, ``hierarchical``'s
  all-gather inside the node, DeepSpeed's all-gather of the server packets in
  :mod:`gradcomp.schemes.onebit_allreduce`). A rank whose own part failed still takes part, with
  its slot marked failed (zeroed: an all-zero header, which :func:`gradcomp.schemes.check.
  check_headers` names as a rank that failed; or the scheme's own status mark), and raises its
  error only once the collective is done -- so every rank's call fails instead of some ranks
  waiting for the process group's timeout.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .context import NULL_PROBE, chain, collective_failed


def _zero(slot: torch.Tensor) -> None:
    slot.zero_()


def all_gather_failsafe(gathered: torch.Tensor, slot: torch.Tensor, group: Any, failed: Optional[BaseException],
                        finish: Callable[[], Any], what: str, *, probe=None,
                        mark_failed: Optional[Callable[[torch.Tensor], None]] = None,
                        device: Optional[torch.device] = None, wait: bool = False):
    """``all_gather_into_tensor(gathered, slot)`` over ``group``, then ``finish()``, failure-safe.

    When ``failed`` (this rank's error from the work before the all-gather) is set, ``slot`` is
    first marked failed (``mark_failed(slot)``; default: zeroed); the all-gather runs either way,
    and once it completed ``failed`` is raised before anything else, else ``finish()`` runs (the
    scheme's header checks and decodes; its result is the result). The all-gather is timed as
    ``"comm_s"`` on ``probe``.

    Args:
        gathered, slot: the all-gather's output and this rank's input.
        group: the process group (None: the default group).
        failed: this rank's earlier error, or None.
        finish: called with no argument after a successful all-gather.
        what: the collective, for the error message (e.g. "scheme 'two_phase': the all-gather of
            the summed chunks").
        probe: times ``"comm_s"`` (None: :class:`gradcomp.schemes.context.NullProbe`).
        mark_failed: how a failed rank marks its slot (default: zeroes it).
        device: with ``wait=False``, a CUDA device makes the returned Future CUDA-aware
            (:func:`gradcomp.schemes.context.chain`).
        wait: False (the schemes): the all-gather is asynchronous and the result a Future whose
            callback (attached through :func:`chain`) raises or finishes. True (a blocking call
            such as DeepSpeed's ``compressed_allreduce``): the all-gather is waited for in the
            calling thread (a failure raised as :func:`collective_failed` naming ``what``), then
            ``failed`` is raised or ``finish()``'s value returned.

    Returns:
        ``wait=False``: a Future of ``finish()``'s value; it raises ``failed``, a
        :class:`gradcomp.CollectiveError` when the all-gather failed, or ``finish()``'s error.
        ``wait=True``: ``finish()``'s value.
    """
    probe = probe or NULL_PROBE
    if failed is not None:
        (mark_failed or _zero)(slot)
    t0 = probe.clock("comm_s")
    if wait:
        try:
            dist.all_gather_into_tensor(gathered, slot, group=group)
        except Exception as e:  # noqa: BLE001 - a failed collective: named, cause kept
            raise collective_failed(what, e) from e
        probe.tock("comm_s", t0)
        if failed is not None:
            raise failed
        return finish()
    work = dist.all_gather_into_tensor(gathered, slot, group=group, async_op=True)

    def done(_):
        probe.tock("comm_s", t0)
        if failed is not None:
            raise failed
        return finish()

    return chain(work.get_future(), done, what, device=device)
