"""The late-row audit: the rows Spark dropped behind the watermark, replayed from the checkpoint.

The loop and its bookkeeping live here (``start``, ``options``, ``handle``, ``auditor``,
``status``, ``pacing``, ``retention``, ``sinks``, ``plugin``); the replay engine in ``replay/``
(one module per source kind in ``replay/sources/``), who moved the watermark in ``jumps/``, the
audit from another application in ``sidecar/``, and the report's part in ``report/``
(docs/architecture.md).
"""
