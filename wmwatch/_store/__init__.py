"""The DuckDB history file: its schema and migrations, and the one writer thread that fills it."""
