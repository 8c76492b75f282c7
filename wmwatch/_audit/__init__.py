"""The late-row audit: the rows Spark dropped behind the watermark, replayed from the checkpoint.

``checkpoint`` reads offsets, commits and source logs; ``predicates`` holds each operator's
late-row rule; ``auditor`` runs the replay and writes the rows; ``report`` holds the pure rules
the report's late-rows section uses.
"""
