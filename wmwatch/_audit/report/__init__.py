"""The audit's part of ``wmwatch report``, by layer: ``folders`` (the Parquet folders the history
lists), ``loading`` (the SQL), ``advice`` (the arithmetic), ``section`` (rendering, and the
section itself) and ``series`` (the HTML report's series)."""
