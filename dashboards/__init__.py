"""wmwatch's operations as code: Grafana dashboards and Prometheus alert rules.

``overview``, ``query`` and ``health`` each build one dashboard from one function per panel
(factories in ``_panels``); ``alerts`` holds the alert rules with production and test profiles;
``generate`` renders all of them into committed files. Run ``python -m dashboards`` from the
repository root to regenerate, ``python -m dashboards --check`` to fail on stale files.
"""
