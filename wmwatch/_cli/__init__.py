"""The ``wmwatch`` commands, one module each; ``demo_job`` is the demo's streaming job."""
