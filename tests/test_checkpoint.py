"""Reading a checkpoint's offsets, commits and file-source log, without a JVM.

The file contents below are copied from checkpoints Spark 4.3 wrote in real runs (conf trimmed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wmwatch._checkpoint.fs import (
    CheckpointDamaged,
    CheckpointEntryGone,
    CheckpointFormatUnknown,
    local_root,
    normalise_path,
)
from wmwatch._checkpoint.reader import (
    CheckpointReader,
    files_for_log_range,
    parse_log_offset,
    parse_offsets,
    parse_source_log,
)
from wmwatch._errors import AuditError

OFFSETS_1 = (
    'v1\n{"batchWatermarkMs":1704067225000,"batchTimestampMs":1795320159072,"conf":'
    '{"spark.sql.streaming.multipleWatermarkPolicy":"min","spark.sql.shuffle.partitions":"2"}}\n'
    '{"logOffset":0}'
)


def test_offsets_file_parses_watermark_conf_and_source_offsets() -> None:
    entry = parse_offsets(1, OFFSETS_1)
    assert entry.watermark_ms == 1704067225000
    assert entry.timestamp_ms == 1795320159072
    assert entry.conf["spark.sql.streaming.multipleWatermarkPolicy"] == "min"
    assert entry.source_offsets == ('{"logOffset":0}',)
    assert parse_log_offset(entry.source_offsets[0]) == 0


def test_offsets_file_with_a_source_not_started_and_trailing_newline() -> None:
    entry = parse_offsets(0, 'v1\n{"batchWatermarkMs":0}\n-\n{"logOffset":4}\n')
    assert entry.source_offsets == (None, '{"logOffset":4}')
    assert entry.timestamp_ms is None


def test_unknown_log_version_costs_the_batch() -> None:
    with pytest.raises(CheckpointFormatUnknown, match="offsets/0 is in log format 'v2'"):
        parse_offsets(0, 'v2\n{"batchWatermarkMs":0}\n')


def test_non_file_source_offsets_cost_the_batch() -> None:
    with pytest.raises(CheckpointDamaged, match="is not a file source's offset"):
        parse_log_offset('{"topic":{"0":42}}')
    assert parse_log_offset(None) is None
    assert parse_log_offset("7") == 7
    assert parse_log_offset('{"logOffset":-1}') == -1  # before the source's first file


def test_source_log_lines() -> None:
    files = parse_source_log(
        'v1\n{"path":"file:///tmp/in/a.json","timestamp":1795320155285,"batchId":0}\n'
        '{"path":"file:///tmp/in/b.json","timestamp":1795320155290,"batchId":0}\n'
    )
    assert [(f.path, f.log_id) for f in files] == [
        ("file:///tmp/in/a.json", 0),
        ("file:///tmp/in/b.json", 0),
    ]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("file:///tmp/in/a.json", "/tmp/in/a.json"),  # the source log's spelling
        ("file:/tmp/in/a.json", "/tmp/in/a.json"),  # _metadata.file_path's spelling
        ("file:/tmp/in/a%20b.json", "/tmp/in/a b.json"),
        ("/tmp/in/a.json", "/tmp/in/a.json"),
        ("s3a://bucket/in/a.json", "s3a://bucket/in/a.json"),
        ("file://host/share/a.json", "file://host/share/a.json"),
    ],
)
def test_normalise_path(given: str, expected: str) -> None:
    assert normalise_path(given) == expected


def test_local_root() -> None:
    assert local_root("file:/tmp/ck") == "/tmp/ck"
    assert local_root("file:///tmp/ck") == "/tmp/ck"
    assert local_root("/tmp/ck") == "/tmp/ck"
    assert local_root("s3a://bucket/ck") is None
    assert local_root("hdfs://nn:8020/ck") is None


def _entry(path: str, log_id: int) -> str:
    return json.dumps({"path": path, "timestamp": 1, "batchId": log_id})


def _log_dir() -> dict[str, str]:
    """Log numbers 0-9 compacted into 9.compact (plain 0-8 cleaned up), 10 and 11 plain."""
    compact = "v1\n" + "\n".join(_entry(f"file:///in/{i}.json", i) for i in range(10))
    return {
        "9.compact": compact,
        "10": "v1\n" + _entry("file:///in/10a.json", 10) + "\n" + _entry("file:///in/10b.json", 10),
        "11": "v1\n" + _entry("file:///in/11.json", 11),
    }


def test_log_range_reads_compact_and_plain_files() -> None:
    files = _log_dir()
    got = files_for_log_range(files.keys, files.get, 8, 10)
    assert [f.path for f in got] == [
        "file:///in/8.json",
        "file:///in/9.json",
        "file:///in/10a.json",
        "file:///in/10b.json",
    ]
    assert files_for_log_range(files.keys, files.get, 5, 4) == []


def test_log_range_prefers_the_plain_file_while_it_exists() -> None:
    files = _log_dir()
    files["3"] = "v1\n" + _entry("file:///in/3.json", 3)
    reads: list[str] = []

    def read(name: str) -> str | None:
        reads.append(name)
        return files.get(name)

    assert [f.path for f in files_for_log_range(files.keys, read, 3, 3)] == ["file:///in/3.json"]
    assert reads == ["3"]


def test_log_range_past_the_end_is_an_error() -> None:
    files = _log_dir()
    with pytest.raises(AuditError, match="log number 12"):
        files_for_log_range(files.keys, files.get, 12, 12)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _offsets(wm_ms: int, log_offset: int | None) -> str:
    line = "-" if log_offset is None else json.dumps({"logOffset": log_offset})
    return f'v1\n{{"batchWatermarkMs":{wm_ms},"batchTimestampMs":1,"conf":{{}}}}\n{line}'


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """Batches: 0 reads log 0; 1 is a no-data batch moving the watermark; 2 reads logs 1 and 2;
    3 is committed without a file; 4 is planned but not committed."""
    root = tmp_path / "ck"
    plan = [(0, 0), (15_000, 0), (15_000, 2), (30_000, 2), (30_000, 3)]
    for batch_id, (wm, log_offset) in enumerate(plan):
        _write(root / "offsets" / str(batch_id), _offsets(wm, log_offset))
        if batch_id < 4:
            _write(root / "commits" / str(batch_id), '{"nextBatchWatermarkMs":0}')
    for log_id in range(4):
        _write(
            root / "sources" / "0" / str(log_id),
            "v1\n" + _entry(f"file:///in/{log_id}.json", log_id),
        )
    _write(root / "offsets" / ".0.crc", "junk")
    return root


def test_reader_maps_batches_to_their_files(checkpoint: Path) -> None:
    reader = CheckpointReader(f"file:{checkpoint}")
    assert reader.committed_batches() == [0, 1, 2, 3]
    assert reader.offset_batches() == [0, 1, 2, 3, 4]
    assert [f.path for f in reader.batch_files(0)] == ["file:///in/0.json"]
    assert reader.batch_files(1) == []  # no-data batch
    assert [f.path for f in reader.batch_files(2)] == ["file:///in/1.json", "file:///in/2.json"]
    assert reader.batch_files(3) == []
    assert [f.path for f in reader.batch_files(4)] == ["file:///in/3.json"]
    # Spark writes a line per source ("-" before its first offset): one missing is damage
    with pytest.raises(CheckpointDamaged, match="none for source 1"):
        reader.batch_files(2, source_index=1)


def test_late_watermark_is_the_previous_batch_watermark(checkpoint: Path) -> None:
    reader = CheckpointReader(str(checkpoint))
    assert reader.late_watermark_ms(0) is None
    assert reader.late_watermark_ms(1) == 0
    assert reader.late_watermark_ms(2) == 15_000  # set by the no-data batch 1
    assert reader.late_watermark_ms(4) == 30_000


def test_purged_offsets_make_a_batch_unauditable(checkpoint: Path) -> None:
    (checkpoint / "offsets" / "1").unlink()
    reader = CheckpointReader(str(checkpoint))
    with pytest.raises(AuditError, match="minBatchesToRetain"):
        reader.late_watermark_ms(2)
    with pytest.raises(AuditError, match="offsets/1"):
        reader.batch_files(2)


def test_remote_checkpoint_needs_a_filesystem() -> None:
    with pytest.raises(AuditError, match="not on a local filesystem"):
        CheckpointReader("s3a://bucket/ck")


def test_the_connect_checkpoint_cache_is_bounded_in_entries_and_size() -> None:
    from wmwatch._audit.replay.connect import TextCache

    cache = TextCache(max_entries=3, max_chars=100)
    for i in range(5):
        cache.put(f"offsets/{i}", "x" * 10)
    # the oldest two went; the newest three are kept
    assert len(cache) == 3 and cache.get("offsets/0") is None and cache.get("offsets/4") == "x" * 10
    # a large text (a compacted source log) is not kept and pushes nothing out
    cache.put("sources/0/9.compact", "y" * 26)
    assert cache.get("sources/0/9.compact") is None and len(cache) == 3
    # texts under the entry cap still leave, oldest first, when their total passes the size cap
    sized = TextCache(max_entries=100, max_chars=100)
    for name in ("a", "b", "c", "d"):
        sized.put(name, "z" * 25)
    sized.get("a")  # used last: kept
    sized.put("e", "z" * 25)
    assert sized.chars == 100 and len(sized) == 4
    assert sized.get("b") is None and sized.get("a") == "z" * 25
    # a key put again replaces its text and its size
    sized.put("e", "w")
    assert sized.get("e") == "w" and sized.chars == 76


@pytest.mark.parametrize(
    "metadata",
    [
        "[1, 2]",  # JSON of another shape
        '"text"',
        '{"batchWatermarkMs": "soon"}',
        '{"batchWatermarkMs": 0, "batchTimestampMs": [1]}',
        '{"batchWatermarkMs": 0, "conf": ["a"]}',
    ],
)
def test_offsets_metadata_of_another_shape_is_a_damaged_checkpoint(metadata: str) -> None:
    with pytest.raises(CheckpointDamaged, match=r"offsets/3 .*; the checkpoint is damaged"):
        parse_offsets(3, f'v1\n{metadata}\n{{"logOffset":0}}')


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"timestamp": 1}',
        "[1]",
        '{"path": "a", "batchId": "x"}',
        '{"path": ["a"], "batchId": 1}',
        '{"path": "a", "batchId": -4}',
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_a_source_log_line_that_is_no_file_entry_is_a_damaged_checkpoint(line: str) -> None:
    with pytest.raises(CheckpointDamaged, match="sources/0/4"):
        parse_source_log(f"v1\n{line}\n", "sources/0/4")


# -- each kind of damage costs its batch, as CheckpointDamaged (never a retried error) -------------

_DEEP = "[" * 100_000 + "]" * 100_000  # Python's parser gives up (RecursionError) far sooner


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("\x00\x9f\x13garbage\nmore", "does not start with a log version line"),
        ("\ufffd\ufffdPK\x03\x04", "does not start with a log version line"),
        ("v1", "has no metadata line"),
        ("v1\n{not json", "metadata is not JSON"),
        (f"v1\n{_DEEP}", "metadata is nested too deep"),
        ('v1\n{"batchWatermarkMs": true}', "batchWatermarkMs is True"),
        ('v1\n{"batchWatermarkMs": -5}', "batchWatermarkMs is -5"),
        (f'v1\n{{"batchWatermarkMs": {2**63}}}', "batchWatermarkMs is 9223372036854775808"),
        ('v1\n{"batchWatermarkMs": 1.5}', "batchWatermarkMs is float"),
        ('v1\n{"batchWatermarkMs": 0, "conf": {"a": [1]}}', "conf is not the object"),
    ],
)
def test_every_kind_of_damaged_offsets_file_is_checkpoint_damage(text: str, says: str) -> None:
    with pytest.raises(CheckpointDamaged, match=f"offsets/7 .*{says}") as raised:
        parse_offsets(7, text)
    assert "\n" not in str(raised.value)
    assert "garbage" not in str(raised.value) and "PK" not in str(raised.value)  # never echoed


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"logOffset": "12"}', "logOffset is str"),
        ('{"logOffset": 1.0}', "logOffset is float"),
        ('{"logOffset": true}', "logOffset is True"),
        ('{"logOffset": [1]}', "logOffset is list"),
        ('{"logOffset": -2}', "logOffset is -2"),
        (f'{{"logOffset": {2**63}}}', "logOffset is 9223372036854775808"),
        ('{"logOffset": 1', "is not JSON"),
        (_DEEP, "is nested too deep"),
        ('{"topic":{"0":42}}', "is not a file source's offset"),
        ('"12"', "is not a file source's offset"),
    ],
)
def test_every_kind_of_damaged_file_source_offset_is_checkpoint_damage(
    line: str, says: str
) -> None:
    with pytest.raises(CheckpointDamaged, match=says):
        parse_log_offset(line)


def _damaged_checkpoint(root: Path, damage: dict[int, str]) -> Path:
    """Batches 0-5 each read one source-log entry (0-5, the first ten compacted into
    9.compact as Spark does), with ``damage`` written over the named offsets files."""
    for batch_id in range(6):
        text = damage.get(batch_id, _offsets(1_000 * batch_id, batch_id))
        _write(root / "offsets" / str(batch_id), text)
        _write(root / "commits" / str(batch_id), 'v1\n{"nextBatchWatermarkMs":0}')
    _write(
        root / "sources" / "0" / "9.compact",
        "v1\n" + "\n".join(_entry(f"file:///in/{i}.json", i) for i in range(10)),
    )
    return root


@pytest.mark.parametrize(
    "damage",
    [
        "",
        "\x00\x01\x02",
        'v2\n{"batchWatermarkMs":0}\n{"logOffset":3}',
        f"v1\n{_DEEP}\n" + '{"logOffset":3}',
        'v1\n{"batchWatermarkMs":0}\n{"logOffset":"3"}',
        'v1\n{"batchWatermarkMs":0}\n{"logOffset":-100000000}',
        f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{2**63}}}',
        'v1\n{"batchWatermarkMs":0}',  # the source's line cut off
    ],
)
def test_a_damaged_offsets_file_costs_its_batch_and_the_next_only(
    tmp_path: Path, damage: str
) -> None:
    """offsets/3 damaged: batch 3 cannot be read, nor batch 4 (which starts where 3 ended);
    every other batch reads as before, the newest readable offsets are found, and nothing
    raises anything but CheckpointDamaged (which the audit counts as a lost batch)."""
    reader = CheckpointReader(str(_damaged_checkpoint(tmp_path / "ck", {3: damage})))
    for batch_id in (0, 1, 2, 5):
        (entry,) = reader.batch_files(batch_id)
        assert entry.path == f"file:///in/{batch_id}.json"
    if damage.startswith('v1\n{"batchWatermarkMs":0}') and "[" not in damage:
        assert reader.late_watermark_ms(4) == 0  # the metadata line itself is fine
    else:
        with pytest.raises(CheckpointDamaged, match="offsets/3, where batch 4 starts,"):
            reader.late_watermark_ms(4)
    for batch_id in (3, 4):
        with pytest.raises(CheckpointDamaged, match="offsets/3"):
            reader.batch_files(batch_id)
    latest = reader.latest_offsets()
    assert latest is not None and latest.batch_id == 5


def test_a_damaged_newest_offsets_file_is_passed_over(tmp_path: Path) -> None:
    reader = CheckpointReader(str(_damaged_checkpoint(tmp_path / "ck", {5: "\x89PNG\r\n"})))
    latest = reader.latest_offsets()
    assert latest is not None and latest.batch_id == 4
    with pytest.raises(CheckpointDamaged, match="offsets/5 does not start with"):
        reader.batch_files(5)


def test_reading_a_log_range_is_bounded_by_the_files_not_the_numbers() -> None:
    """A damaged offset can name any range; the reader reads each file once and stops at the
    first number the log does not hold (a range of 10^12 numbers, or one that ends in a compact
    file numbered 10^8, used to be walked number by number)."""
    reads: list[str] = []
    files = {"9.compact": "v1\n" + "\n".join(_entry(f"file:///in/{i}.json", i) for i in range(10))}
    files["100000000.compact"] = files["9.compact"]

    def read(name: str) -> str | None:
        reads.append(name)
        return files.get(name)

    with pytest.raises(CheckpointEntryGone, match="no entry for log number 10;"):
        files_for_log_range(files.keys, read, 0, 10**12)
    with pytest.raises(CheckpointEntryGone, match="no entry for log number 10;"):
        files_for_log_range(files.keys, read, 5, 100_000_000)
    with pytest.raises(CheckpointDamaged, match="below its first entry"):
        files_for_log_range(files.keys, read, -99_999_999, 3)
    assert len(reads) <= 2
    assert [f.log_id for f in files_for_log_range(files.keys, read, 3, 5)] == [3, 4, 5]


def test_a_fifo_or_device_in_a_checkpoint_is_refused_without_hanging(tmp_path: Path) -> None:
    import os

    (tmp_path / "offsets").mkdir()
    os.mkfifo(tmp_path / "offsets" / "0")  # a reader that opened it blocking would hang here
    (tmp_path / "offsets" / "1").symlink_to("/dev/zero")  # ... or fill memory
    reader = CheckpointReader(str(tmp_path))
    for batch in (0, 1):
        with pytest.raises(AuditError, match="is not a regular file; the checkpoint is damaged"):
            reader.offsets(batch)


def test_a_checkpoint_file_over_the_read_bound_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wmwatch._checkpoint.fs as checkpoint_module

    monkeypatch.setattr(checkpoint_module, "MAX_FILE_BYTES", 1024)
    (tmp_path / "offsets").mkdir()
    (tmp_path / "offsets" / "0").write_text(OFFSETS_1 + "\n" + " " * 2048)
    with pytest.raises(AuditError, match="more than the 1,024 wmwatch reads"):
        CheckpointReader(str(tmp_path)).offsets(0)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        _DEEP,
        '{"reservoirVersion": 2, "index": 1}',
        '{"reservoirVersion": 2, "index": 1, "isStartingVersion": "false"}',
        '{"reservoirVersion": -1, "index": 1, "isStartingVersion": false}',
        '{"reservoirVersion": "2", "index": 1, "isStartingVersion": false}',
        '{"reservoirVersion": 2, "index": -7, "isStartingVersion": false}',
        f'{{"reservoirVersion": {2**63}, "index": 1, "isStartingVersion": false}}',
        "[2, 1, false]",
    ],
)
def test_a_damaged_delta_offset_line_costs_its_batch(line: str) -> None:
    from wmwatch._audit.replay.sources.delta import parse_delta_offset

    with pytest.raises(CheckpointDamaged, match="end offset"):
        parse_delta_offset(line, "end")
    good = '{"sourceVersion":1,"reservoirVersion":2,"index":-1,"isStartingVersion":true}'
    offset = parse_delta_offset(good, "end")
    assert (offset.version, offset.index, offset.initial_snapshot) == (2, -1, True)
    # the base index as Delta writes it with sourceVersion 3 (DeltaSourceOffset.BASE_INDEX_V3)
    v3 = '{"sourceVersion":3,"reservoirVersion":7,"index":-100,"isStartingVersion":false}'
    assert parse_delta_offset(v3, "end").index == -100


def test_the_watermark_a_batch_left_is_read_from_its_commit(tmp_path: Path) -> None:
    """``commits/N`` holds the watermark batch N left for the next one; the sidecar's check
    takes the newest batches that moved it (a damaged commit passes its batch over)."""
    from wmwatch._audit.sidecar.settings import _moved_the_watermark

    root = _damaged_checkpoint(tmp_path / "ck", {})
    for batch_id, after_ms in enumerate((0, 1_000, 2_500, 2_500, 9_000, 9_000)):
        _write(
            root / "commits" / str(batch_id),
            f'v1\n{{"nextBatchWatermarkMs":{after_ms}}}',
        )
    reader = CheckpointReader(str(root))
    assert reader.watermark_after_ms(2) == 2_500
    assert reader.watermark_after_ms(9) is None
    # state checkpoint format 2 writes its commits as v2, with the state ids beside
    _write(root / "commits" / "3", 'v2\n{"nextBatchWatermarkMs":2500,"stateUniqueIds":{}}')
    assert reader.watermark_after_ms(3) == 2_500
    # offsets/N holds the watermark batch N ran with, 1000 * N here: 2 (2000 -> 2500), 4 and 5
    # moved it; 0 and 1 left it as it was, 3 left less (no batch lowers it: a damaged pair)
    moved = list(_moved_the_watermark(reader))
    assert moved == [(5, 9_000), (4, 9_000), (2, 2_500)]
    _write(root / "commits" / "4", "v1\n{broken")
    with pytest.raises(CheckpointDamaged, match="commits/4 is not JSON"):
        reader.watermark_after_ms(4)
    assert [b for b, _ in _moved_the_watermark(reader)] == [5, 2]


def test_recorded_settings_that_differ_are_named_with_both_values() -> None:
    from wmwatch._audit.sidecar.settings import conf_differences

    recorded = {"spark.sql.shuffle.partitions": "200", "spark.sql.streaming.x": "1"}
    session = {"spark.sql.shuffle.partitions": "4"}
    assert conf_differences(recorded, session.get) == [
        "spark.sql.shuffle.partitions (production 200, sidecar 4)"
    ]
    assert conf_differences(recorded, {"spark.sql.shuffle.partitions": "200"}.get) == []
