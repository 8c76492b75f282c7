"""Dashboards as code: the committed JSON is what the code renders, loads back through the SDK's
own model, uses only wmwatch's metric names, and every expression parses in real promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins as cog_plugins
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

from dashboards import generate
from tests.harness.metrics import expressions, load, panels
from tests.prom_servers import PROMTOOL, require

ROOT = generate.ROOT
COMMITTED = sorted((ROOT / generate.DASHBOARD_DIR).glob("*.json"))

# The metric names in the team brief: dashboards and rules may use these and nothing else.
BRIEF_METRICS = {
    "wmwatch_watermark_seconds", "wmwatch_event_time_max_seconds", "wmwatch_event_time_min_seconds",
    "wmwatch_event_time_avg_seconds", "wmwatch_watermark_lag_seconds",
    "wmwatch_event_time_delay_seconds", "wmwatch_event_time_spread_seconds",
    "wmwatch_input_rows_total", "wmwatch_batch_input_rows", "wmwatch_input_rows_per_second",
    "wmwatch_processed_rows_per_second", "wmwatch_batch_duration_seconds",
    "wmwatch_batch_phase_duration_seconds", "wmwatch_batches_total",
    "wmwatch_rows_dropped_by_watermark_total", "wmwatch_state_rows",
    "wmwatch_state_rows_removed_total", "wmwatch_state_memory_bytes",
    "wmwatch_last_progress_timestamp_seconds", "wmwatch_last_event_timestamp_seconds",
    "wmwatch_query_up", "wmwatch_query_failed",
    "wmwatch_query_info", "wmwatch_events_received_total", "wmwatch_events_dropped_total",
    "wmwatch_listener_errors_total", "wmwatch_event_queue_size", "wmwatch_store_up",
    "wmwatch_store_pending_writes", "wmwatch_store_errors_total", "wmwatch_event_handling_seconds",
    "wmwatch_late_rows_audited_total", "wmwatch_audit_lag_batches", "wmwatch_audit_lag_seconds",
    "wmwatch_join_state_unbounded", "wmwatch_state_growth_rows_per_second",
    "wmwatch_operator_watermark_seconds", "wmwatch_source_watermark_seconds",
    "wmwatch_source_event_time_max_seconds", "wmwatch_watermark_holding_back",
    "wmwatch_findings_active",
    # late-row storms: batches over the audit's max_rows_per_batch
    "wmwatch_audit_batches_over_cap_total", "wmwatch_late_rows_over_cap_total",
    # an audit falling behind the checkpoint's retention
    "wmwatch_audit_retention_batches_remaining", "wmwatch_audit_batches_lost_total",
    # a row dated ahead of the clock moved the watermark
    "wmwatch_event_time_ahead_seconds",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\bwmwatch_[a-z_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) if "handling" in n else n for n in names}


def test_the_three_dashboards_are_committed() -> None:
    assert [p.stem for p in COMMITTED] == sorted(generate.DASHBOARDS)
    assert sorted(generate.DASHBOARDS) == ["wmwatch-health", "wmwatch-overview", "wmwatch-query"]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.stem)
def test_committed_json_round_trips_through_the_sdk_model(path: Path) -> None:
    cog_plugins.register_default_plugins()
    text = path.read_text(encoding="utf-8")
    board = dashboard_models.Dashboard.from_json(json.loads(text))
    assert board.uid == path.stem
    queries = [
        t
        for p in board.panels or []
        if isinstance(p, dashboard_models.Panel)
        for t in p.targets or []
    ]
    assert queries and all(isinstance(q, prometheus_models.Dataquery) for q in queries)
    assert generate.dashboard_json(board) == text


def test_regenerating_is_byte_for_byte_identical_to_the_committed_files() -> None:
    first = generate.generated_files()
    second = generate.generated_files()
    assert first == second
    for relative, content in first.items():
        assert (ROOT / relative).read_text(encoding="utf-8") == content, f"{relative} is stale"
    assert generate.stale() == []


def _copy_generated(tmp_path: Path) -> None:
    for relative in generate.generated_files():
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, target)


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dashboards", "--check", "--root", str(root)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_check_mode_fails_on_a_stale_file_and_regeneration_fixes_it(tmp_path: Path) -> None:
    _copy_generated(tmp_path)
    assert _check(tmp_path).returncode == 0
    stale = tmp_path / generate.DASHBOARD_DIR / "wmwatch-query.json"
    stale.write_text(stale.read_text().replace("Watermark lag", "Watermark lag (edited)"))
    (tmp_path / generate.RULES_PATH).unlink()
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "stale: dashboards/json/wmwatch-query.json" in result.stderr
    assert f"stale: {generate.RULES_PATH}" in result.stderr
    assert "python -m dashboards" in result.stderr
    regen = subprocess.run(
        [sys.executable, "-m", "dashboards", "--root", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert regen.returncode == 0 and "wrote dashboards/json/wmwatch-query.json" in regen.stdout
    assert _check(tmp_path).returncode == 0


@pytest.mark.parametrize("uid", sorted(generate.DASHBOARDS))
def test_dashboards_use_only_the_metric_names_of_the_brief(uid: str) -> None:
    used = set().union(*(metric_names(e) for e in expressions(load(uid))))
    assert used and used <= BRIEF_METRICS, used - BRIEF_METRICS


def test_rules_use_only_the_metric_names_of_the_brief() -> None:
    from dashboards import alerts

    for rule in alerts.rules(alerts.PRODUCTION):
        assert metric_names(rule.expr) <= BRIEF_METRICS, rule.alert
        # the e2e test evaluates the signal: it must be the part of the rule that fetches data
        assert rule.signal in rule.expr, rule.alert


def test_overview_covers_the_on_call_questions_with_a_multi_query_variable() -> None:
    board = load("wmwatch-overview")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["query"]["multi"] and variables["query"]["includeAll"]
    assert variables["query"]["query"] == "label_values(wmwatch_query_info, query)"
    used = set().union(*(metric_names(e) for e in expressions(board)))
    for needed in (
        "wmwatch_watermark_lag_seconds", "wmwatch_input_rows_per_second",
        "wmwatch_processed_rows_per_second", "wmwatch_rows_dropped_by_watermark_total",
        "wmwatch_state_rows", "wmwatch_state_memory_bytes", "wmwatch_query_up",
        "wmwatch_query_failed",
    ):  # fmt: skip
        assert needed in used, needed
    assert all('query=~"$query"' in e for e in expressions(board))


def test_drill_down_shows_watermarks_lateness_state_batches_audit_and_findings() -> None:
    board = load("wmwatch-query")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["query"]["multi"] is False
    used = set().union(*(metric_names(e) for e in expressions(board)))
    for needed in (
        "wmwatch_watermark_seconds", "wmwatch_event_time_max_seconds",
        "wmwatch_event_time_min_seconds",
        "wmwatch_watermark_lag_seconds", "wmwatch_event_time_delay_seconds",
        "wmwatch_operator_watermark_seconds", "wmwatch_source_watermark_seconds",
        "wmwatch_state_rows", "wmwatch_state_memory_bytes", "wmwatch_batch_phase_duration_seconds",
        "wmwatch_late_rows_audited_total", "wmwatch_findings_active",
    ):  # fmt: skip
        assert needed in used, needed
    # Grafana's date units are in milliseconds
    for panel in panels(board):
        if panel["fieldConfig"]["defaults"].get("unit") == "dateTimeAsIso":
            assert all(t["expr"].endswith("* 1000") for t in panel["targets"]), panel["title"]


def test_health_dashboard_shows_drops_errors_audit_lag_and_store() -> None:
    used = set().union(*(metric_names(e) for e in expressions(load("wmwatch-health"))))
    for needed in (
        "wmwatch_events_dropped_total", "wmwatch_listener_errors_total",
        "wmwatch_audit_lag_batches",
        "wmwatch_audit_lag_seconds", "wmwatch_store_up", "wmwatch_event_queue_size",
    ):  # fmt: skip
        assert needed in used, needed


@pytest.mark.parametrize("uid", sorted(generate.DASHBOARDS))
def test_panels_have_ids_titles_units_descriptions_and_the_datasource_variable(uid: str) -> None:
    board = load(uid)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and 0 not in ids
    for panel in panels(board):
        assert panel["title"] and panel["description"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids) and all(ref_ids)
    names = [v["name"] for v in board["templating"]["list"]]
    assert names[0] == "datasource"


def substitute_grafana_variables(expr: str, query_regex: str = ".+") -> str:
    """What Grafana does before sending a panel's expression to Prometheus."""
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("$query", query_regex)
    )


def test_every_panel_expression_parses_in_promtool(tmp_path: Path) -> None:
    rules = [
        {
            "record": f"wmwatch_check:{uid.replace('-', '_')}:{index}",
            "expr": substitute_grafana_variables(e),
        }
        for uid in sorted(generate.DASHBOARDS)
        for index, e in enumerate(expressions(load(uid)))
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run(
        [require(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_a_broken_expression_is_caught_by_the_promtool_check(tmp_path: Path) -> None:
    # guards the check above: promtool must reject what Grafana would fail to run
    path = tmp_path / "broken.yml"
    bad = substitute_grafana_variables(
        'sum by (query) (rate(wmwatch_batches_total{query=~"$query"}))'
    )
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": [{"record": "x:y", "expr": bad}]}]})
    )
    result = subprocess.run(
        [require(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode != 0
