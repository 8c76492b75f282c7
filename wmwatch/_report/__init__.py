"""``wmwatch report``: the history file summarised per query.

``model`` holds what a report is made of, ``build`` chooses the queries and builds the core
summary, ``sections`` lists the sections each feature owns (late rows from ``_audit``, findings
and watermarks from ``_inspect``; their contract is :mod:`wmwatch._section`), ``render`` writes
the table, JSON and CSV.
"""
