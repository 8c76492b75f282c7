"""A query's source options are looked up as Spark looks them up: in any case
(``CaseInsensitiveMap``), the last value given winning. One helper, ``SourceOptions``, and each
kind of source's look-ups through it, without a JVM; the real-Spark test of a file source read
with ``.option("cleansource", "archive")`` is in tests/test_audit_spark.py."""

from __future__ import annotations

import pytest

from wmwatch._audit.replay.sources.base import SourceOptions
from wmwatch._audit.replay.sources.delta import delta_spec_of
from wmwatch._audit.replay.sources.files import FileSourceSpec, _no_clean_source, _paths
from wmwatch._audit.replay.sources.kafka import _STREAM_ONLY, KafkaSourceSpec, kafka_positions
from wmwatch._audit.replay.sources.python import PythonSourceSpec
from wmwatch._errors import UnsupportedSourceError


def test_options_are_found_in_any_case_and_given_back_as_written() -> None:
    options = SourceOptions({"cleanSource": "off", "maxFilesPerTrigger": 1, "PATH": "/in"})
    assert options["cleansource"] == options["CLEANSOURCE"] == "off"
    assert "maxfilespertrigger" in options and "path" in options and "nope" not in options
    assert options.get("MaxFilesPerTrigger") == "1" and options.get("nope", "x") == "x"
    assert list(options) == ["cleanSource", "maxFilesPerTrigger", "PATH"]  # as given
    assert dict(options.items())["PATH"] == "/in"
    assert options.without("path", "MAXFILESPERTRIGGER") == {"cleanSource": "off"}
    # a Connect client's plan can hold one option in two spellings: the last one wins, and a
    # refusal sees both
    both = SourceOptions({"cleanSource": "off", "cleansource": "delete"})
    assert both["cleanSource"] == "delete" and both.every("CleanSource") == ("off", "delete")
    assert SourceOptions.of(both) is both and SourceOptions.of(None) == {}
    assert "delete" not in repr(both)  # values are never shown (Kafka's hold credentials)


@pytest.mark.parametrize(
    "given",
    [
        {"cleanSource": "delete"},
        {"cleansource": "delete"},
        {"CLEANSOURCE": "Archive", "sourceArchiveDir": "/archive"},
        {"cleanSource": "off", "cleansource": "archive"},
    ],
)
def test_a_file_source_that_moves_its_files_is_refused_in_any_spelling(
    given: dict[str, str],
) -> None:
    with pytest.raises(UnsupportedSourceError, match="moves or deletes its files"):
        _no_clean_source(SourceOptions(given))


def test_a_file_sources_path_and_options_in_any_case() -> None:
    _no_clean_source(SourceOptions({"CleanSource": "OFF"}))
    assert _paths((), SourceOptions({"Path": "/in"})) == ("/in",)
    assert _paths(("/a",), SourceOptions({"path": "/in"})) == ("/a",)
    spec = FileSourceSpec("json", "{}", {"BasePath": "/in", "multiLine": "true"}, ("/in",))
    assert isinstance(spec.options, SourceOptions) and "basepath" in spec.options


def test_kafka_options_in_any_case() -> None:
    spec = KafkaSourceSpec(
        options={"SUBSCRIBE": "clicks", "FailOnDataLoss": "false", "kafka.bootstrap.servers": "b"},
        schema_json="{}",
    )
    assert spec.description == "kafka subscribe=clicks"
    # the replay reads as the query did: failOnDataLoss=false, whatever its spelling
    assert spec.options.get("failOnDataLoss", "true") == "false"
    # what a batch read must not be handed is dropped in any spelling; the rest is kept
    assert spec.options.without(*_STREAM_ONLY) == {"kafka.bootstrap.servers": "b"}
    described = ["KafkaV2[Subscribe[views]]", "KafkaV2[Subscribe[clicks]]"]
    assert kafka_positions(described, spec) == [1]


def test_delta_options_in_any_case() -> None:
    spec = delta_spec_of({"STARTINGVERSION": "3", "skipchangecommits": "True"}, ["/table"], "{}")
    assert spec.starting_version == 3 and spec.skip_change_commits
    spec = delta_spec_of({"PATH": "/table", "StartingTimestamp": "2026-01-01"}, [], "{}")
    assert spec.path == "/table" and spec.starting_timestamp == "2026-01-01"
    with pytest.raises(UnsupportedSourceError, match="readChangeFeed"):
        delta_spec_of({"READCHANGEFEED": "true"}, ["/table"], "{}")


def test_python_source_options_in_any_case() -> None:
    spec = PythonSourceSpec("counting", {"Step": "7"}, "{}", object)
    assert spec.options["step"] == "7" and list(spec.options) == ["Step"]
