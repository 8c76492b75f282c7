"""The DuckDB history file: opening and locking it (``files``), its schema, migrations and
retention (``schema``), the core tables' rows (``rows``) and the one writer thread that fills it
(``writer``)."""
