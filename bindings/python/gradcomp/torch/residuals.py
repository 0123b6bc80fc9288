"""Error-feedback state: where each parameter's residual lives (the README's "DDP communication hook").

Error feedback (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019; for top-k, Aji & Heafield 2017 and Lin et al. 2018) keeps, per gradient
element, what a rank computed but did not send, and adds it to the next gradient.

A :class:`ResidualStore` holds:

- layouts (:class:`Layout`): one per bucket layout, i.e. per (numel, dtype, device, parameter
  map); a layout owns flat float32 slots of its numel -- ``"residual"`` (the worker residual),
  one backup per slot under ``nonfinite="restore"`` -- and the map ``[(key, offset, length)]``
  (elements of the flat bucket; a parameter's residual is ``residual[offset:offset + length]``,
  in the gradient's memory order);
- parameter homes: for each parameter key (a name) either its slice in a layout or, between
  layouts, a *pending* float32 tensor of its own;
- remap on rebuild: when a layout is activated each parameter's residual is copied into it once
  and the old slice is zeroed (a stale layout then holds no mass);
- flush to the dense path: a parameter going dense adds its residual to the gradient it sends
  and loses it; under ``"restore"`` a copy comes back as pending if the step turns out non-finite
  (the Compressor decides, one step late);
- restore/reset after a non-finite step, on the device with no host synchronization;
- rescaling by a device scalar (a loss scale that changed, :meth:`ResidualStore.scale_`);
- state as ``{key: float32 1-D tensor}`` for checkpoints.

All tensors are float32 whatever the bucket dtype. The store never communicates and never reads
device values on the host.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

NONFINITE_MODES = ("restore", "reset")

ParamMap = Sequence[Tuple[str, int, int]]


class Layout:
    """One bucket layout: flat float32 slots and the parameter map.

    Attributes:
        key: the caller's identity of the bucket (e.g. ``("index", 3)``); a new layout at the
            same key replaces the old one.
        signature: ``(numel, dtype, device, params)``; a layout is reused while it is unchanged.
        numel, dtype, device: of the flat bucket (the residual is float32 whatever ``dtype``).
        params: ``[(param key, offset, length)]`` in bucket order, in elements.
        slots: slot name -> float32 tensor of ``numel`` elements, allocated by
            :meth:`ResidualStore.activate` (``"residual"``).
        backups: slot name -> float32 copy taken before a step (``nonfinite="restore"`` only).
    """

    def __init__(self, key, numel: int, dtype: torch.dtype, device: torch.device, params: ParamMap):
        self.key = key
        self.numel = int(numel)
        self.dtype = dtype
        self.device = device
        self.params = [(str(k), int(o), int(n)) for k, o, n in params]
        self.signature = (self.numel, dtype, str(device), tuple(self.params))
        self.slots: Dict[str, torch.Tensor] = {}
        self.backups: Dict[str, torch.Tensor] = {}

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """The ``"residual"`` slot, or None before activation."""
        return self.slots.get("residual")


class ResidualStore:
    """Residual layouts and parameter homes for one compressor on one rank.

    Args:
        nonfinite: ``"restore"`` (keep a backup of each slot; a non-finite step puts it back) or
            ``"reset"`` (a non-finite step zeroes the slots; no extra memory).
        slot_names: the float32 slots a layout holds once activated (default ``("residual",)``;
            a two-level scheme would add a server residual, DGC a momentum).

    Raises:
        ValueError: an unknown ``nonfinite`` mode.
    """

    def __init__(self, nonfinite: str = "restore", slot_names: Sequence[str] = ("residual",)):
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={nonfinite!r}; accepted: {', '.join(NONFINITE_MODES)}")
        self.nonfinite = nonfinite
        self.slot_names = tuple(slot_names)
        self._layouts: Dict[object, Layout] = {}
        self._slice: Dict[str, Tuple[Layout, int, int]] = {}  # key -> (layout, offset, length)
        self._pending: Dict[str, torch.Tensor] = {}  # key -> float32 tensor (no layout holds it)

    # -- layouts -------------------------------------------------------------------------------
    def layout(self, key, numel: int, dtype: torch.dtype, device: torch.device, params: ParamMap) -> Layout:
        """The layout at ``key`` for this (numel, dtype, device, params); a new, inactive one
        (no slots yet) replaces the old when any of them changed (a DDP bucket rebuild)."""
        lay = Layout(key, numel, dtype, device, params)
        old = self._layouts.get(key)
        if old is not None and old.signature == lay.signature:
            return old
        self._layouts[key] = lay
        return lay

    def layouts(self) -> List[Layout]:
        """The current layouts, one per key, in key insertion order."""
        return list(self._layouts.values())

    def activate(self, lay: Layout) -> None:
        """Allocate the layout's slots (zeros; plus backups under ``"restore"``) and move every
        parameter of its map home: a residual held elsewhere (an older layout or pending) is
        copied into its slice once and released there. No-op when already active."""
        if lay.residual is not None:
            return
        for name in self.slot_names:
            lay.slots[name] = torch.zeros(lay.numel, dtype=torch.float32, device=lay.device)
        res = lay.residual
        for key, off, n in lay.params:
            src = self._tensor(key)
            if src is not None:
                res[off: off + n].copy_(src)
                self._release(key)
            self._slice[key] = (lay, off, n)
        if self.nonfinite == "restore":
            for name, t in lay.slots.items():
                lay.backups[name] = torch.empty_like(t)

    # -- a step --------------------------------------------------------------------------------
    def slots(self, lay: Layout) -> Dict[str, torch.Tensor]:
        """The layout's slots as a scheme takes them (``{"residual": flat float32}``)."""
        return dict(lay.slots)

    def snapshot(self, lay: Layout) -> None:
        """Before a step (``"restore"``): copy every slot into its backup (on the device)."""
        for name, b in lay.backups.items():
            b.copy_(lay.slots[name])

    def settle(self, lay: Layout, nonfinite: torch.Tensor) -> None:
        """After a step, with ``nonfinite`` a 0-dim device bool (the averaged result held a
        non-finite value): put the backups back (``"restore"``) or zero the slots (``"reset"``)
        where it is set, on the device, without a host synchronization."""
        for name, t in lay.slots.items():
            if self.nonfinite == "restore":
                torch.where(nonfinite, lay.backups[name], t, out=t)
            else:
                t.masked_fill_(nonfinite, 0.0)

    def flush(self, lay: Layout, flat: torch.Tensor) -> List[Tuple[str, Optional[torch.Tensor]]]:
        """Parameters of ``lay`` going dense: add each one's residual (rounded to ``flat``'s dtype)
        to its slice of the flat bucket ``flat`` and forget it (a layout slice is zeroed).

        Returns ``[(key, saved)]`` for every flushed parameter, ``saved`` being a float32 copy of
        the residual under ``"restore"`` (else None), for :meth:`keep_flushed`.
        """
        flushed = []
        for key, off, cnt in lay.params:
            src = self._tensor(key)
            if src is None:
                continue
            saved = src.clone() if self.nonfinite == "restore" else None
            flat[off: off + cnt].add_(src.to(flat.dtype))
            self._release(key)
            flushed.append((key, saved))
        return flushed

    def keep_flushed(self, flushed, nonfinite: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """After the dense allreduce of flushed parameters: each saved residual comes back as
        pending, ``where(nonfinite, saved, 0)`` (so a non-finite step loses nothing), unless the
        parameter already has a home again. Returns the ``[(key, pending tensor)]`` set, which the
        caller drops through :meth:`drop_pending` once the step is known finite."""
        kept = []
        for key, saved in flushed:
            if saved is None:
                continue
            pend = torch.where(nonfinite, saved, torch.zeros_like(saved))
            if key not in self._slice and key not in self._pending:
                self._pending[key] = pend
                kept.append((key, pend))
        return kept

    def drop_pending(self, key: str, tensor: torch.Tensor) -> None:
        """Forget ``key``'s pending residual if it is still ``tensor`` (the step was finite)."""
        if self._pending.get(key) is tensor:
            del self._pending[key]

    def scale_(self, factor: torch.Tensor) -> None:
        """Multiply every residual -- the slots of every layout that is some parameter's home,
        and every pending tensor -- by the 0-dim float32 ``factor`` in place, on their devices
        (no host read). Backups are not scaled: :meth:`snapshot` rewrites them before use."""
        homes = {id(lay): lay for lay, _, _ in self._slice.values()}
        for lay in homes.values():
            f = factor.to(lay.device, non_blocking=True)
            for t in lay.slots.values():
                t.mul_(f)
        for t in self._pending.values():
            t.mul_(factor.to(t.device, non_blocking=True))

    # -- per parameter -------------------------------------------------------------------------
    def residual(self, key: str) -> Optional[torch.Tensor]:
        """A float32 copy of ``key``'s residual (1-D, its length), or None when it has none."""
        t = self._tensor(key)
        return None if t is None else t.detach().clone()

    def length(self, key: str) -> Optional[int]:
        """Elements of ``key``'s residual, or None when it has none."""
        t = self._tensor(key)
        return None if t is None else t.numel()

    def state(self) -> Dict[str, torch.Tensor]:
        """``{key: float32 1-D copy}`` of every parameter that holds a residual."""
        keys = list(self._slice) + list(self._pending)
        return {k: self._tensor(k).detach().clone() for k in keys}

    def load(self, key: str, tensor: torch.Tensor) -> None:
        """Set ``key``'s residual to ``tensor`` (float32, 1-D, its length; bit-exact): copied into
        its slice when it has one, else kept (cloned) as pending until a layout takes it."""
        home = self._slice.get(key)
        if home is not None:
            lay, off, n = home
            lay.residual[off: off + n].copy_(tensor)
        else:
            self._pending[key] = tensor.clone()

    def _tensor(self, key: str) -> Optional[torch.Tensor]:
        home = self._slice.get(key)
        if home is not None:
            lay, off, n = home
            return lay.residual[off: off + n]
        return self._pending.get(key)

    def _release(self, key: str) -> None:
        """Forget ``key``'s home; a layout slice is zeroed so the stale layout holds no mass."""
        home = self._slice.pop(key, None)
        if home is not None:
            lay, off, n = home
            lay.residual[off: off + n].zero_()
        else:
            self._pending.pop(key, None)
