"""The replay engine: a committed batch's input read again in Spark, and the rows it dropped.

``plan`` reads the audit's facts off the query's plan, ``predicates`` holds each stateful
operator's late-row rule, ``sources`` reads each kind of source again (one module per kind),
``events``/``events_connect`` put the rows through ``events`` as written (``refusals`` says why
not), ``connect`` is what a Spark Connect client can learn, and ``engine`` runs the replay.
"""
