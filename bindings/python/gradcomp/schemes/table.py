"""THE scheme table: one line per scheme, in the order of ``auto``'s candidates and of every
list of scheme names gradcomp shows. A scheme is its own file (its run function, context,
byte steps and :class:`gradcomp.schemes.base.Scheme` description) plus one line here; nothing
else names it. The table is handed to the planner (:func:`gradcomp.planner.schemes.register`)
when this module is imported (``import gradcomp`` does).
"""

from ..planner import schemes as _planner_schemes
from .allgather import GATHER
from .allreduce import DENSE, SUM
from .hierarchical import HIERARCHICAL
from .majority import MAJORITY
from .rs_ag import RS_AG
from .two_phase import TWO_PHASE

TABLE = (
    DENSE,
    SUM,
    GATHER,
    TWO_PHASE,
    HIERARCHICAL,
    RS_AG,
    MAJORITY,
)
"""Every scheme, in order."""

_planner_schemes.register(TABLE)
