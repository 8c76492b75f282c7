"""Plan inspection: join-state and watermark checks read from the running query's plan.

``joins`` and ``watermarks`` hold the pure rules, ``findings`` the diagnosed problems and their
table, ``plugin`` reads Spark and puts them together.
"""
