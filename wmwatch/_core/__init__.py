"""The event path: Spark's listener events in, parsed once, into the query book and to plugins.

``listener`` receives events onto a bounded queue; ``worker`` is the one thread that handles
them (parse, query book, history, plugins) and notices terminations Spark's bus lost;
``state`` keeps every query's latest snapshot and counters (what /metrics reads); ``health``
counts what wmwatch itself received, dropped and failed on; ``options`` holds what a watch is
made with; ``sessions`` keeps one watch per SparkSession; ``plugins`` is the contract features
ride on, and the typed view of the watch they get; ``spark_jobs`` bounds every Spark job a
feature starts.
"""
