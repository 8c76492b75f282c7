"""The wmwatch exception family.

    WmwatchError                 every error wmwatch raises on purpose
    ├── ConfigError              a bad argument or option (the message says which and why)
    ├── ProgressParseError       a progress document without the fields every batch has
    ├── StoreError               the DuckDB history file cannot be opened, created or migrated
    ├── MetricsServerError       the /metrics endpoint cannot be served (port in use, bad TLS files)
    ├── UnknownQueryError        a report names a query the history does not hold
    ├── SparkStartError          a command of wmwatch's could not start Spark (Java, jars, address)
    └── AuditError               a late-row audit cannot be started or run
        └── UnsupportedSourceError   the query reads a source the audit cannot replay exactly

Every message is one sentence that says what happened and what to do about it.
"""

from __future__ import annotations


class WmwatchError(Exception):
    """Base class of every error wmwatch raises on purpose."""


class ConfigError(WmwatchError, ValueError):
    """A bad argument or option."""


class ProgressParseError(WmwatchError, ValueError):
    """A progress document lacks the fields that identify a batch."""


class StoreError(WmwatchError):
    """The DuckDB history file cannot be opened, created or migrated."""


class MetricsServerError(WmwatchError):
    """The metrics endpoint cannot be served."""


class UnknownQueryError(WmwatchError, LookupError):
    """A report names no recorded query; the message lists the known ones."""


class SparkStartError(WmwatchError):
    """A command of wmwatch's could not start Spark: no Java, a jar it cannot fetch, an address."""


class AuditError(WmwatchError):
    """A late-row audit cannot be started or run."""


class UnsupportedSourceError(AuditError):
    """The audited query reads a source whose batches cannot be replayed exactly."""
