"""The scheme table as the planner reads it (torch-free).

The planner owns the primitives (ring formulas, chunking, link times); each scheme owns how it
composes them (its ``steps``, ``packet_bytes`` and ``kernels``, in its own file under
:mod:`gradcomp.schemes`). The dependency runs schemes -> planner, so the planner does not import
the schemes: :mod:`gradcomp.schemes.table` hands its table to :func:`register` when it is
imported, which ``import gradcomp`` does. Every list of scheme names (``auto``'s candidates,
hierarchical's inner schemes, the CLI choices, the accepted values in error messages) is read
from here.
"""

from typing import Any, Dict, Iterable, Tuple

_TABLE: Dict[str, Any] = {}


def register(table: Iterable[Any]) -> None:
    """Make the scheme descriptions of ``table`` (:class:`gradcomp.schemes.base.Scheme`) the
    planner's, in table order (the order of candidates and of the names in messages).

    Raises:
        ValueError: two entries of one name.
    """
    entries = list(table)
    names = [s.name for s in entries]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"planner: the scheme table names {dup} more than once")
    _TABLE.clear()
    _TABLE.update((s.name, s) for s in entries)


def get(name: str) -> Any:
    """The description of scheme ``name``.

    Raises:
        ValueError: no scheme of that name (the accepted names are in the message).
    """
    try:
        return _TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"planner: scheme={name!r}; accepted: {', '.join(_TABLE) or '(no scheme table loaded)'}") \
            from None


def names(*, flat: bool = None) -> Tuple[str, ...]:
    """The scheme names in table order; ``flat=True``: only the flat ones (one ring over the
    group: ``auto``'s and hierarchical's inner candidates), ``flat=False``: only the others."""
    return tuple(n for n, s in _TABLE.items() if flat is None or bool(s.flat) == flat)


def candidates(codec: Any) -> Tuple[str, ...]:
    """The flat schemes ``auto``'s cost model predicts for ``codec``, in table order: those that
    accept it and whose ``candidate(codec)`` is true."""
    return tuple(n for n, s in _TABLE.items() if s.flat and s.accepts(codec) and s.candidate(codec))
