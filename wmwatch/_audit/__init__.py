"""The late-row audit: the rows Spark dropped behind the watermark, replayed from the checkpoint.

``start`` checks and wires an audit (:func:`start_audit`, :class:`AuditHandle`); ``auditor``
runs one query's audit loop on its own thread, with ``status`` (its counters), ``retention``
(batches the checkpoint no longer holds) and ``pacing`` (when a replay may run); ``checkpoint``
reads offsets, commits and source logs; ``sources`` reads each kind of source again, one module
per kind and one registry; ``predicates`` holds each operator's
late-row rule; ``replay`` finds a batch's late rows in Spark; ``sinks`` writes them and the
audit's markers to the history; ``plugin`` holds the per-query counters and metrics; ``report``
holds the feature's report section and advice.
"""

from wmwatch._audit.start import AuditHandle, start_audit

__all__ = ["AuditHandle", "start_audit"]
