"""Seeing what happens: placements, communication and the layout, as text.

``typeof`` names a tensor's dtype, shape and placement; ``visualize`` draws which rank holds which
block; ``trace_comms`` records every collective a function launches beside the layout's optimum;
``explain`` shows what a layout does to a model on a mesh; ``recording`` keeps the raw log of
collectives (a :class:`CommsLog`) for counts of your own. Nothing below the tools imports this.
"""

from cpshard.comm.record import CommsLog, recording
from cpshard.debug.comms_report import CommsReport, trace_comms
from cpshard.debug.explain import Explanation, explain
from cpshard.debug.typeof import typeof
from cpshard.debug.visualize import visualize

__all__ = [
    "CommsLog",
    "CommsReport",
    "Explanation",
    "explain",
    "recording",
    "trace_comms",
    "typeof",
    "visualize",
]
