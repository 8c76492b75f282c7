"""A streaming query's checkpoint, read without the query: below both the audit and inspection.

``reader`` reads offsets, commits and source logs (local or Hadoop filesystems), bounded and
treating damage as damage; ``history`` reads the query's history from the checkpoint alone and
``tables`` writes it to the history tables (``wmwatch checkpoint-history``, and the sidecar's
batch history); ``state`` counts state rows with Spark's state readers; ``section`` is that
feature's report section.
"""
