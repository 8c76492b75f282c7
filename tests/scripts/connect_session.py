"""The local Spark Connect session the subprocess test drivers share (server JVM started by
pyspark)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def local_connect_session() -> Any:
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.remote("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
