"""A streaming query's checkpoint, read without the query: below both the audit and inspection.

``reader`` reads offsets, commits and source logs (local or Hadoop filesystems), bounded and
treating damage as damage; ``history`` builds the query's history tables from the checkpoint
alone (``wmwatch checkpoint-history``, and the sidecar's batch history), ``state`` counts state
rows with Spark's state readers, ``section`` is that feature's report section.
"""
