"""The writer's defaults that the command line shows in its help.

Kept apart from the writer (which imports anndata) so that ``deltacells info`` and
``deltacells verify`` start without importing the writing stack.
"""

from __future__ import annotations

__all__ = ["DEFAULT_TILE_SIZE", "JOINS"]

#: Cells per tile by default. That is about 3 MB per tile on typical 10x data, a good object
#: size for one GET, and small enough that shuffling buffers of several tiles stay modest.
DEFAULT_TILE_SIZE = 4096
#: How the genes of several inputs are combined (``write_deltacells(join=...)``).
JOINS = ("same", "inner", "outer")
