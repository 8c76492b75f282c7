"""What a report is made of: the queries it covers, each query's summary, and its sections
(the summary and the section contract are :mod:`wmwatch._section`'s).

Plain data, built once by :mod:`wmwatch._report.build` and only read by
:mod:`wmwatch._report.render`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from wmwatch._section import QuerySummary, Section


@dataclass(frozen=True, slots=True)
class QueryRef:
    query_id: str
    name: str | None

    @property
    def label(self) -> str:
        return self.name or self.query_id


@dataclass(slots=True)
class Report:
    db: str
    generated_at: datetime
    since_at: datetime | None
    queries: list[QuerySummary]
    sections: tuple[Section, ...]
