"""The sections a report shows after each query's core summary, in the order it shows them.

Each feature owns its tables and so its section (loader, renderer, CSV columns); this tuple is
the one place that lists them. To add one, write it in the feature's ``report`` module and add
it here.
"""

from __future__ import annotations

from wmwatch._audit.jumps.section import WATERMARK_JUMPS_SECTION
from wmwatch._audit.report.section import LATE_ROWS_SECTION
from wmwatch._checkpoint.section import CHECKPOINT_SECTION
from wmwatch._inspect.section import FINDINGS_SECTION, WATERMARKS_SECTION
from wmwatch._section import Section

SECTIONS: tuple[Section, ...] = (
    WATERMARK_JUMPS_SECTION,
    LATE_ROWS_SECTION,
    FINDINGS_SECTION,
    WATERMARKS_SECTION,
    CHECKPOINT_SECTION,
)
