"""Small factories shared by every wmwatch dashboard: queries, panel kinds, layout.

Each dashboard module writes one function per panel on top of these, so a panel reads as its
title, its unit and its PromQL, and every panel gets the same data source, legend and ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models

# The dashboards pick their Prometheus through a variable, so one JSON works with any data
# source name; deploy/grafana provisions one with this uid as the default.
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every query-scoped selector filters on this; `=~` lets one expression serve a single query,
# a multi-selection and "All".
QUERY = 'query=~"$query"'

PanelBuilder = cogbuilder.Builder[dashboard_models.Panel]


@dataclass(frozen=True)
class Target:
    """One PromQL expression of a panel, with its legend."""

    expr: str
    legend: str = ""


def prometheus_query(target: Target, ref_id: str, *, instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(target.expr).ref_id(ref_id).datasource(DATASOURCE)
    if target.legend:
        query = query.legend_format(target.legend)
    return query.instant() if instant else query.range()


def _ref_ids(targets: Sequence[Target]) -> list[str]:
    return [chr(ord("A") + index) for index in range(len(targets))]


def timeseries_panel(
    title: str,
    unit: str,
    targets: Sequence[Target],
    *,
    description: str,
    width: int = 12,
    height: int = 8,
    stacked: bool = False,
    bars: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        .line_width(1)
        .fill_opacity(10)
        .span_nulls(True)
    )
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    for target, ref_id in zip(targets, _ref_ids(targets), strict=True):
        panel = panel.with_target(prometheus_query(target, ref_id))
    return panel


def stat_panel(
    title: str,
    unit: str,
    target: Target,
    *,
    description: str,
    thresholds: Sequence[tuple[float | None, str]] = ((None, "green"),),
    width: int = 6,
    height: int = 4,
) -> stat.Panel:
    steps = [dashboard_models.Threshold(value=value, color=color) for value, color in thresholds]
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        .thresholds(
            dashboard_builders.ThresholdsConfig()
            .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
            .steps(steps)
        )
        .with_target(prometheus_query(target, "A", instant=True))
    )


def datasource_variable() -> dashboard_builders.DatasourceVariable:
    return (
        dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus")
    )


def query_variable(*, multi: bool) -> dashboard_builders.QueryVariable:
    variable = (
        dashboard_builders.QueryVariable("query")
        .label("Query")
        .description("Streaming query: its name, or its id when it has none.")
        .datasource(DATASOURCE)
        .query("label_values(wmwatch_query_info, query)")
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
        .multi(multi)
        .include_all(multi)
    )
    if multi:
        variable = variable.all_value(".*")
    return variable


def assemble(
    *,
    uid: str,
    title: str,
    description: str,
    rows: Sequence[tuple[str, Sequence[PanelBuilder]]],
    multi_query: bool | None,
) -> dashboard_models.Dashboard:
    """A dashboard with the shared settings; ``multi_query=None`` means no query variable."""
    board = (
        dashboard_builders.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["wmwatch", "spark", "streaming"])
        .editable()
        .time("now-1h", "now")
        .timezone("utc")
        .refresh("30s")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
        .link(
            dashboard_builders.DashboardLink("wmwatch")
            .type(dashboard_models.DashboardLinkType.DASHBOARDS)
            .tags(["wmwatch"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    if multi_query is not None:
        board = board.with_variable(query_variable(multi=multi_query))
    panel_id = 0
    for row_title, panels in rows:
        panel_id += 1
        board = board.with_row(dashboard_builders.Row(row_title).id(panel_id))
        for panel in panels:
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))  # type: ignore[attr-defined]  # the generic Builder type has no id(); every panel builder does
    return board.build()
