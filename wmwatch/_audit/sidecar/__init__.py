"""The audit as a sidecar: the same audit run in an application of its own against another
application's checkpoint (``run``), writing that query's batch history as it goes (``history``),
with the query's definition loaded as the command names it (``definition``)."""
