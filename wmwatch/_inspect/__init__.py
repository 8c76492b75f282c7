"""Plan inspection: join-state and watermark checks read from the running query's plan.

``joins`` and ``watermarks`` hold the pure rules, ``findings`` the diagnosed problems, ``plan``
reads the plan's facts and watermarks from Spark (py4j or Connect's explain text) and ``reads``
runs those reads on their own thread. ``state`` is what is known of one query, ``evaluate`` turns
it into findings, ``tables`` writes the feature's tables (``findings``, ``operator_watermarks``,
``source_watermarks``), ``metrics`` builds its metric families and ``report`` holds its report
sections. ``plugin`` puts them together on the watch.

``checkpoint_history`` reads a query's history from its checkpoint alone (no query, no listener)
into the same tables, counting state with ``checkpoint_state``; the ``checkpoint-history``
command runs it.
"""
