"""The options a watch is made with, gathered once by ``attach`` or ``Watch`` and passed on.

Defaults are ``attach``'s. :meth:`WatchOptions.as_requested` is what tells two attaches to one
session apart: paths and addresses resolved as the watch resolves them, so ``"h.duckdb"`` and
``"./h.duckdb"`` are the same option.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from wmwatch._core.plugins import WatchPlugin

DEFAULT_METRICS_ADDR = "127.0.0.1"
METRICS_ADDR_VARIABLE = "WMWATCH_METRICS_ADDR"
# History kept by default: about 1.3 MB per 1,000 batches on the driver's disk must not grow
# forever unnoticed; ``retention_days=None`` keeps everything.
DEFAULT_RETENTION_DAYS = 30.0


@dataclass(frozen=True)
class WatchOptions:
    """Every option of ``attach`` and ``Watch`` (documented on ``attach``), with its defaults."""

    db: str | os.PathLike[str] | None = "wmwatch.duckdb"
    metrics_port: int | None = 9108
    metrics_addr: str | None = None
    registry: CollectorRegistry | None = None
    metrics_certfile: str | None = None
    metrics_keyfile: str | None = None
    metrics_basic_auth: tuple[str, str] | None = None
    strict: bool = False
    queue_capacity: int = 10_000
    forget_after_seconds: float = 600.0
    retention_days: float | None = DEFAULT_RETENTION_DAYS
    db_flush_seconds: float = 2.0
    listener: str = "auto"
    plugins: Iterable[WatchPlugin] = ()
    inspect_plans: bool = True
    state_budget_bytes: int | None = None
    pushgateway: str | None = None
    push_job: str = "wmwatch"
    push_basic_auth: tuple[str, str] | None = None
    push_cafile: str | None = None
    push_certfile: str | None = None
    push_keyfile: str | None = None
    otlp_endpoint: str | None = None
    otlp_protocol: str = "http/protobuf"
    otlp_headers: Mapping[str, str] | None = None
    otlp_cafile: str | None = None
    otlp_certfile: str | None = None
    otlp_keyfile: str | None = None
    otlp_interval_seconds: float = 10.0
    otlp_timeout_seconds: float = 5.0
    otlp_service_name: str | None = None
    otlp_resource_attributes: Mapping[str, str] | None = None
    otlp_traces: bool = False

    def __post_init__(self) -> None:
        # an iterator would be used up by the first watch; the options must stay comparable
        object.__setattr__(self, "plugins", tuple(self.plugins))
        # copies: a caller's dict changed later must not change what the watch was made with
        for name in ("otlp_headers", "otlp_resource_attributes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, dict(value))

    @property
    def bind_addr(self) -> str:
        """The /metrics bind address: the option, else ``$WMWATCH_METRICS_ADDR``, else loopback."""
        return self.metrics_addr or os.environ.get(METRICS_ADDR_VARIABLE) or DEFAULT_METRICS_ADDR

    def as_requested(self) -> dict[str, Any]:
        """Every option by name, as the watch resolves it (see the module docstring)."""
        requested = {field.name: getattr(self, field.name) for field in fields(self)}
        db = self.db
        requested["db"] = str(Path(db).expanduser().absolute()) if db is not None else None
        requested["metrics_port"] = self.metrics_port or None
        requested["metrics_addr"] = self.bind_addr
        return requested
