"""Metrics out: the scrape-time collector, the /metrics endpoint, and Pushgateway mode."""
