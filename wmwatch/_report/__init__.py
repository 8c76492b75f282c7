"""``wmwatch report``: the history file summarised per query.

``model`` holds what a report is made of, ``build`` chooses the queries and builds the core
summary, ``sections`` lists the sections each feature owns (late rows from ``_audit``, findings
and watermarks from ``_inspect``), ``render`` writes the table, JSON and CSV, ``format`` the
durations and sizes, ``rows`` reads SQL results by column name.
"""
