"""The event path: Spark's listener events in, parsed once, into the query book and to plugins.

``listener`` receives events onto a bounded queue; ``state`` keeps every query's latest
snapshot and counters (what /metrics reads); ``health`` counts what wmwatch itself received,
dropped and failed on; ``plugins`` is the contract features ride on; ``spark_jobs`` bounds every
Spark job a feature starts.
"""
