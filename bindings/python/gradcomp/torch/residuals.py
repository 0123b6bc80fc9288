"""Error-feedback state: where each parameter's residual lives (the README's "DDP communication hook").

Error feedback (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019; for top-k, Aji & Heafield 2017 and Lin et al. 2018) keeps, per gradient
element, what a rank computed but did not send, and adds it to the next gradient.

A :class:`ResidualStore` holds:

- layouts (:class:`Layout`): one per bucket layout, i.e. per (numel, dtype, device, parameter
  map); a layout owns flat float32 slots of its numel -- ``"residual"`` (the worker residual),
  one backup per slot (the value before the step: what a non-finite step under
  ``nonfinite="restore"`` and a failed step put back) -- and the map ``[(key, offset, length)]``
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
- undo of a failed step (:mod:`gradcomp.torch.journal`): :meth:`ResidualStore.restore` puts a
  layout's backups back, :meth:`ResidualStore.unflush` gives flushed residuals back;
- rescaling by a device scalar (a loss scale that changed, :meth:`ResidualStore.scale_`);
- state as ``{key: float32 1-D tensor}`` for checkpoints;
- server residuals of the ``two_phase`` scheme (below).

Server residuals (``two_phase``; DeepSpeed's ``server_error``, Tang et al. 2021). A two_phase
layout also owns a float32 slot ``"server"`` covering this rank's chunk of the bucket,
``(start, count)`` = :func:`gradcomp.planner.chunk` (numel, W, rank), in units of the average
(what this rank's second encode of the chunk's sum did not send). It is not a parameter's: its
chunk follows bucket offsets, and every other rank holds the server residual of another chunk.
What the ranks owe the average per element e is sum_r worker_r[e] / W + server[e] (the server
term held by e's chunk owner), so a server residual is never dropped while the layout changes;
it is *folded*: ``worker[start:start + count] = fl(worker + fl(W * server))`` on this rank (the
elements' own parameters' residuals), then the server slot is zeroed. The next encode of those
elements sends fl(x' / W), which carries the folded W * server / W = server. Folding happens:

- (a) bucket rebuild: a new layout at the same key replaces the old (:meth:`ResidualStore.layout`),
  or a layout gives up a parameter to another layout (:meth:`ResidualStore.activate`): the old
  layout is folded before its residuals move, and the new layout's server slot starts at zero;
- (b) dense steps: a layout whose parameters go dense (:meth:`ResidualStore.flush`, warm-up or a
  dense call) is folded first, so the flushed residual carries the server term into the dense
  allreduce (each rank adds W * server to its chunk; the dense path divides by W); so is a layout
  one of whose parameters becomes exempt (:mod:`gradcomp.torch.policy`: the bucket's compressed
  part is a new layout, and the exempt parameter's residual is flushed into its dense gradient);
- a layout whose chunk changes (another rank in a group of the same size) is folded the same way;
- a codec switch of a ramp (:meth:`ResidualStore.fold`): the same layout, another codec.

(c) Another world size on load drops every residual, server residuals included (a warning, the
Compressor's). (d) Checkpoints: :meth:`ResidualStore.server_state` saves each server slot with
its layout (key, numel, dtype, parameter map, chunk, world size); :meth:`ResidualStore.load_server`
puts it back bit-exact into a layout that matches all of them; a saved slot whose layout is not
the current one at that key while its parameters live in other active layouts is folded into their
residuals at once (by the saved parameter map), and one whose key has no layout yet waits,
pending, for the first activation: restored when that layout matches, folded otherwise (and
when a flush or another layout takes its parameters first). Pending server residuals are saved
again, and rescaled with the others.

Non-finite steps restore (or zero) the server slot with the worker residual: both are slots of
the layout (:meth:`ResidualStore.snapshot`, :meth:`ResidualStore.settle`).

All tensors are float32 whatever the bucket dtype. The store never communicates and never reads
device values on the host.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..codec import _dtype_name as dtype_name

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
        slots: slot name -> float32 tensor, allocated by :meth:`ResidualStore.activate`:
            ``"residual"`` (``numel`` elements) and, for two_phase, ``"server"`` (``chunk``'s
            count).
        backups: slot name -> float32 copy taken before a step (both modes: a failed step is
            undone from it).
        chunk: ``(start, count, world_size)`` of the ``"server"`` slot (two_phase), else None.
        homed: every parameter of the map has its home in this layout.
        server_live: the ``"server"`` slot may hold mass (it was handed to a scheme or loaded
            since its last fold), so a fold adds it exactly once.
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
        self.chunk: Optional[Tuple[int, int, int]] = None
        self.homed = False
        self.server_live = False

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """The ``"residual"`` slot, or None before activation."""
        return self.slots.get("residual")


class ResidualStore:
    """Residual layouts and parameter homes for one compressor on one rank.

    Args:
        nonfinite: ``"restore"`` (a non-finite step puts each slot's backup back) or ``"reset"``
            (a non-finite step zeroes the slots). Both keep the backup: it undoes a failed step.
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
        self._pending_server: List[dict] = []  # loaded server slots waiting for their layout

    # -- layouts -------------------------------------------------------------------------------
    def layout(self, key, numel: int, dtype: torch.dtype, device: torch.device, params: ParamMap) -> Layout:
        """The layout at ``key`` for this (numel, dtype, device, params); a new, inactive one
        (no slots yet) replaces the old when any of them changed (a DDP bucket rebuild)."""
        lay = Layout(key, numel, dtype, device, params)
        old = self._layouts.get(key)
        if old is not None and old.signature == lay.signature:
            return old
        if old is not None:
            self._fold(old)
        self._layouts[key] = lay
        return lay

    def layouts(self) -> List[Layout]:
        """The current layouts, one per key, in key insertion order."""
        return list(self._layouts.values())

    def activate(self, lay: Layout, server: Optional[Tuple[int, int, int]] = None) -> None:
        """Allocate the layout's slots (zeros; plus their backups) and move every
        parameter of its map home: a residual held elsewhere (an older layout, folded first, or
        pending) is copied into its slice once and released there. ``server`` = ``(start,
        count, world_size)`` gives the layout a ``"server"`` slot of ``count`` elements (two_phase;
        a layout whose chunk changes is folded first); a loaded server residual of this layout is
        restored into it, other loaded ones naming its parameters are folded into their
        residuals first (module docstring). Cheap when nothing changed."""
        if lay.residual is None:
            for name in self.slot_names:
                lay.slots[name] = torch.zeros(lay.numel, dtype=torch.float32, device=lay.device)
            for name, t in lay.slots.items():
                lay.backups[name] = torch.empty_like(t)
        if server is not None:
            server = (int(server[0]), int(server[1]), int(server[2]))
        if lay.chunk != server:
            self._fold(lay)
            lay.slots.pop("server", None)
            lay.backups.pop("server", None)
            lay.chunk = server
            lay.server_live = False
            if server is not None:
                lay.slots["server"] = torch.zeros(server[1], dtype=torch.float32, device=lay.device)
                lay.backups["server"] = torch.empty_like(lay.slots["server"])
        if lay.homed:
            return
        self._resolve_pending_server(lay)
        res = lay.residual
        for key, off, n in lay.params:
            home = self._slice.get(key)
            if home is not None and home[0] is lay and home[1] == off:
                continue
            if home is not None:
                self._fold(home[0])
            src = self._tensor(key)
            if src is not None:
                res[off: off + n].copy_(src)
                self._release(key)
            self._slice[key] = (lay, off, n)
        lay.homed = True

    # -- a step --------------------------------------------------------------------------------
    def slots(self, lay: Layout, names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """The layout's slots as a scheme takes them (``{"residual": flat float32}``, plus
        ``"server"`` for two_phase), or only those of ``names`` that it has."""
        out = {k: t for k, t in lay.slots.items() if names is None or k in names}
        if "server" in out:
            lay.server_live = True
        return out

    def snapshot(self, lay: Layout, names: Optional[Sequence[str]] = None) -> None:
        """Before a step: copy every slot (or those of ``names``) into its backup (on the
        device)."""
        for name, b in lay.backups.items():
            if names is None or name in names:
                b.copy_(lay.slots[name])

    def restore(self, lay: Layout, names: Optional[Sequence[str]] = None) -> None:
        """Undo a failed step: copy the backups taken by :meth:`snapshot` back into the slots (or
        those of ``names``), on the device."""
        for name, b in lay.backups.items():
            if (names is None or name in names) and name in lay.slots:
                lay.slots[name].copy_(b)

    def settle(self, lay: Layout, nonfinite: torch.Tensor, names: Optional[Sequence[str]] = None) -> None:
        """After a step, with ``nonfinite`` a 0-dim device bool (the averaged result held a
        non-finite value): put the backups back (``"restore"``) or zero the slots (``"reset"``)
        where it is set -- worker and server residuals alike, or the slots of ``names`` -- on the
        device, without a host synchronization."""
        for name, t in lay.slots.items():
            if names is not None and name not in names:
                continue
            if self.nonfinite == "restore":
                torch.where(nonfinite, lay.backups[name], t, out=t)
            else:
                t.masked_fill_(nonfinite, 0.0)

    def swap_backup(self, lay: Layout, name: str = "residual") -> None:
        """Exchange slot ``name`` with its backup (``"restore"`` only): a caller that wrote the new
        value into the backup buffer (leaving the slot as it was before the step) makes it
        current this way, without a copy; the old value becomes the backup."""
        lay.slots[name], lay.backups[name] = lay.backups[name], lay.slots[name]

    def flush(self, lay: Layout, flat: torch.Tensor) -> List[Tuple[str, Optional[torch.Tensor]]]:
        """Parameters of ``lay`` going dense: add each one's residual (rounded to ``flat``'s dtype)
        to its slice of the flat bucket ``flat`` and forget it (a layout slice is zeroed).

        A two_phase layout is folded first (its server residual joins its parameters' residuals,
        module docstring (b)), and so are loaded server residuals naming its parameters.

        Returns ``[(key, saved)]`` for every flushed parameter, ``saved`` being a float32 copy of
        the residual, for :meth:`keep_flushed` and :meth:`unflush`.
        """
        self._fold(lay)
        names = {k for k, _, _ in lay.params}
        for k, _, _ in lay.params:
            home = self._slice.get(k)
            if home is not None and home[0] is not lay:
                self._fold(home[0])
        self._fold_pending_server(names)
        lay.homed = False
        flushed = []
        for key, off, cnt in lay.params:
            src = self._tensor(key)
            if src is None:
                continue
            saved = src.clone()
            flat[off: off + cnt].add_(src.to(flat.dtype))
            self._release(key)
            flushed.append((key, saved))
        return flushed

    def keep_flushed(self, flushed, nonfinite: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """After the dense allreduce of flushed parameters: each saved residual comes back as
        pending, ``where(nonfinite, saved, 0)`` (so a non-finite step loses nothing), unless the
        parameter already has a home again. Returns the ``[(key, pending tensor)]`` set, which the
        caller drops through :meth:`drop_pending` once the step is known finite. Under
        ``"reset"`` nothing comes back (a non-finite step zeroes residuals)."""
        kept = []
        if self.nonfinite != "restore":
            return kept
        for key, saved in flushed:
            if saved is None:
                continue
            pend = torch.where(nonfinite, saved, torch.zeros_like(saved))
            if key not in self._slice and key not in self._pending:
                self._pending[key] = pend
                kept.append((key, pend))
        return kept

    def unflush(self, flushed) -> None:
        """Undo :meth:`flush` (a failed step): each parameter's saved residual comes back, into
        its slice when a layout has taken it since (that layout's own undo ran first), else as
        pending."""
        for key, saved in flushed:
            home = self._slice.get(key)
            if home is not None:
                lay, off, n = home
                lay.residual[off: off + n].copy_(saved.to(lay.device))
            else:
                self._pending[key] = saved.clone()

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
        for e in self._pending_server:
            t = e["residual"]
            t.mul_(factor.to(t.device, non_blocking=True))

    # -- server residuals (two_phase) ----------------------------------------------------------
    def server_state(self) -> List[dict]:
        """The server residuals, for checkpoints: one dict per current layout holding a
        ``"server"`` slot, then the pending (loaded, not yet placed) ones: ``{"key" (the layout
        key, e.g. ("index", 3)), "numel", "dtype" (str), "params" [(name, offset, length)],
        "start", "count", "world_size", "residual" (float32 1-D copy, count elements)}``."""
        out = []
        for lay, t in self.server_slots():
            start, count, world = lay.chunk
            out.append({"key": lay.key, "numel": lay.numel, "dtype": dtype_name(lay.dtype),
                        "params": list(lay.params), "start": start, "count": count,
                        "world_size": world, "residual": t.detach().clone()})
        for e in self._pending_server:
            out.append(dict(e, params=list(e["params"]), residual=e["residual"].detach().clone()))
        return out

    def server_slots(self) -> List[Tuple[Layout, torch.Tensor]]:
        """``[(layout, its "server" slot)]`` of the current layouts that have one (live views)."""
        return [(lay, lay.slots["server"]) for lay in self._layouts.values() if "server" in lay.slots]

    def load_server(self, entries: Sequence[dict]) -> None:
        """Replace the server residuals by ``entries`` (:meth:`server_state` dicts, ``"residual"``
        on the device it should live on): every current server slot is zeroed, then each entry
        is restored bit-exact into the current layout at its key when that layout is active and
        matches it (numel, dtype, parameter map, chunk and world size), folded into its
        parameters' residuals when the layout differs and the parameters live in active layouts,
        else kept pending for the first activation (module docstring (d)). Call it after the
        worker residuals are loaded (a fold adds onto them)."""
        for lay, t in self.server_slots():
            t.zero_()
            lay.server_live = False
        self._pending_server = []
        for e in entries:
            e = dict(e, key=_key(e["key"]), params=[(str(k), int(o), int(n)) for k, o, n in e["params"]],
                     start=int(e["start"]), count=int(e["count"]), world_size=int(e["world_size"]),
                     residual=e["residual"].detach().to(torch.float32).reshape(-1).clone())
            lay = self._layouts.get(e["key"])
            if lay is not None and lay.homed and _matches(lay, e):
                lay.slots["server"].copy_(e["residual"])
                lay.server_live = True
            elif any(k in self._slice and self._slice[k][0].homed for k, _, _ in e["params"]):
                self._fold_entry(e)
            else:
                self._pending_server.append(e)

    def fold(self, lay: Layout) -> None:
        """Fold ``lay``'s server residual into its worker residual now (module docstring), e.g.
        when another codec takes over the layout (a ramp): the next encode sends it. A no-op
        without a live server slot."""
        self._fold(lay)

    def _fold(self, lay: Layout) -> None:
        """Fold ``lay``'s server slot into its worker residual: ``res[start:start + count] =
        fl(res + fl(W * server))``, then zero it (no-op without one, or when it holds nothing
        since its last fold: each server term is folded exactly once)."""
        t = lay.slots.get("server")
        if t is None or lay.residual is None or not lay.server_live:
            return
        start, count, world = lay.chunk
        lay.residual[start: start + count].add_(t * float(world))
        t.zero_()
        lay.server_live = False

    def _fold_entry(self, e: dict) -> None:
        """Fold a saved server residual into the residuals of the parameters its map puts in its
        chunk, by parameter name (a parameter with no residual gets a pending one)."""
        start, count, world, src = e["start"], e["count"], e["world_size"], e["residual"]
        for key, off, n in e["params"]:
            lo, hi = max(off, start), min(off + n, start + count)
            if lo >= hi:
                continue
            dst = self._tensor(key)
            if dst is None:
                dst = self._pending[key] = torch.zeros(n, dtype=torch.float32, device=src.device)
            dst[lo - off: hi - off].add_(src[lo - start: hi - start].to(dst.device) * float(world))

    def _fold_pending_server(self, names) -> None:
        """Fold every pending server residual whose parameter map names one of ``names``."""
        keep = []
        for e in self._pending_server:
            if any(k in names for k, _, _ in e["params"]):
                self._fold_entry(e)
            else:
                keep.append(e)
        self._pending_server = keep

    def _resolve_pending_server(self, lay: Layout) -> None:
        """Before ``lay``'s parameters move home: restore the pending server residual that
        matches it; fold those at its key that do not and those naming its parameters."""
        names = {k for k, _, _ in lay.params}
        keep = []
        for e in self._pending_server:
            if e["key"] == lay.key and "server" in lay.slots and _matches(lay, e):
                lay.slots["server"].copy_(e["residual"].to(lay.device))
                lay.server_live = True
            elif e["key"] == lay.key or any(k in names for k, _, _ in e["params"]):
                self._fold_entry(e)
            else:
                keep.append(e)
        self._pending_server = keep

    # -- per parameter -------------------------------------------------------------------------
    def residual(self, key: str) -> Optional[torch.Tensor]:
        """A float32 copy of ``key``'s residual (1-D, its length), or None when it has none."""
        t = self._tensor(key)
        return None if t is None else t.detach().clone()

    def length(self, key: str) -> Optional[int]:
        """Elements of ``key``'s residual, or None when it has none."""
        t = self._tensor(key)
        return None if t is None else t.numel()

    def empty(self) -> bool:
        """Whether no parameter holds a residual (no slice in a layout, none pending)."""
        return not self._slice and not self._pending

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
        """Forget ``key``'s home; a layout slice is zeroed so the stale layout holds no mass, and
        the layout is no longer every parameter's home (its next activation homes them again:
        a flush through another layout object -- a bucket with exempt parameters going dense --
        releases the slices of the layout that compresses)."""
        home = self._slice.pop(key, None)
        if home is not None:
            lay, off, n = home
            lay.residual[off: off + n].zero_()
            lay.homed = False
        else:
            self._pending.pop(key, None)


def _key(key):
    """A layout key as saved (a tuple, or a list after some serializers) back to a tuple."""
    return tuple(key) if isinstance(key, list) else key


def _matches(lay: Layout, e: dict) -> bool:
    """Whether the saved server residual ``e`` belongs to ``lay`` exactly: key, numel, dtype,
    parameter map, chunk and world size (the device may differ)."""
    return (e["key"] == lay.key and int(e["numel"]) == lay.numel and e["dtype"] == dtype_name(lay.dtype)
            and [tuple(p) for p in e["params"]] == list(lay.params)
            and lay.chunk == (int(e["start"]), int(e["count"]), int(e["world_size"])))
