"""wmwatch: watermark monitoring and late-data auditing for Spark Structured Streaming.

import wmwatch
watch = wmwatch.attach(spark, db="wmwatch.duckdb", metrics_port=9108)
"""

from wmwatch._attach import Watch, attach
from wmwatch._audit.handle import AuditHandle, SidecarHandle
from wmwatch._core.plugins import WatchPlugin
from wmwatch._errors import (
    AuditError,
    ConfigError,
    MetricsServerError,
    ProgressParseError,
    StoreError,
    UnknownQueryError,
    UnsupportedSourceError,
    WmwatchError,
)
from wmwatch._progress import OperatorProgress, ProgressSnapshot, SourceProgress, parse_progress

__version__ = "0.1.0"

__all__ = [
    "AuditError",
    "AuditHandle",
    "ConfigError",
    "MetricsServerError",
    "OperatorProgress",
    "ProgressParseError",
    "ProgressSnapshot",
    "SidecarHandle",
    "SourceProgress",
    "StoreError",
    "UnknownQueryError",
    "UnsupportedSourceError",
    "Watch",
    "WatchPlugin",
    "WmwatchError",
    "__version__",
    "attach",
    "parse_progress",
]
