"""What the tests share, one module per job; a test module imports these, never another test.

- ``streams``: input rows and files (the out-of-order stream, many small files).
- ``audited``: run a query, audit it, wait, and read what was stored (every source kind).
- ``checks``: the conservation checks (emitted + audited == input) and Spark's own counts.
- ``joins``, ``kafka``, ``delta``: the scenarios of those sources (a join's two inputs and the
  pairs of files feeding them, a topic and its records, a table and its commits).
- ``crash``: the crash-driver base, both sides: a driver process's session and loop, and the
  test's handle on it (status lines, SIGKILL, restart, the progress it recorded).
- ``handmade``: progress documents, late rows and checkpoints made by hand, without a JVM.
- ``metrics``: progress, registries and dashboards for the metrics tests.
- ``cli``: the real CLI through typer's CliRunner.
- ``net``: free ports, whether a port listens, scraping /metrics, certificates.
"""
