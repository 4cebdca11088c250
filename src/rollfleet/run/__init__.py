"""``rollfleet run``: N rollout processes over a data file, sharing an engine and M environments.

:func:`run` with :class:`RunOptions` is the whole command; see docs/run.md.
"""

from rollfleet.run.options import RunOptions
from rollfleet.run.orchestrate import run

__all__ = ["RunOptions", "run"]
