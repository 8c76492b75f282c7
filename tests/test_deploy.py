"""Deploy files: promtool accepts the config, rules and unit tests; compose, Kubernetes and
Grafana provisioning files pass their schemas and point at each other consistently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards import alert_tests, alerts, generate
from tests.prom_servers import PROMTOOL, require

ROOT = generate.ROOT
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require(PROMTOOL), *map(str, args)], capture_output=True, text=True, timeout=120
    )


def read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def test_promtool_accepts_the_prometheus_config() -> None:
    result = promtool("check", "config", DEPLOY / "prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_promtool_accepts_the_rules_and_the_prometheusrule_spec(tmp_path: Path) -> None:
    result = promtool("check", "rules", DEPLOY / "prometheus/rules/wmwatch.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts.rules(alerts.PRODUCTION))} rules found" in result.stdout
    spec = tmp_path / "spec.yml"
    manifest = read_yaml(DEPLOY / "k8s/prometheusrule.yaml")
    spec.write_text(yaml.safe_dump(manifest["spec"]))
    assert promtool("check", "rules", spec).returncode == 0
    assert manifest["spec"] == read_yaml(DEPLOY / "prometheus/rules/wmwatch.rules.yml")


def test_the_test_profile_rules_are_valid_too(tmp_path: Path) -> None:
    path = tmp_path / "test.rules.yml"
    path.write_text(generate.rules_yaml(alerts.TEST))
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass_for_every_alert() -> None:
    result = promtool("test", "rules", DEPLOY / "prometheus/tests/wmwatch.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        check["alertname"]
        for case in read_yaml(DEPLOY / "prometheus/tests/wmwatch.rules.test.yml")["tests"]
        for check in case["alert_rule_test"]
        if check["exp_alerts"]
    }
    assert tested == {rule.alert for rule in alerts.rules(alerts.PRODUCTION)}


@pytest.mark.parametrize(
    ("change", "field", "value"),
    [
        ("a looser lag threshold", "lag_threshold_seconds", 2500),
        ("a longer stall window", "stall_window", "30m"),
    ],
)
def test_the_unit_tests_fail_when_a_rule_changes(
    tmp_path: Path, change: str, field: str, value: Any
) -> None:
    import dataclasses

    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    changed = dataclasses.replace(alerts.PRODUCTION, **{field: value})
    (tmp_path / "rules/wmwatch.rules.yml").write_text(generate.rules_yaml(changed))
    (tmp_path / "tests/t.yml").write_text(
        yaml.safe_dump(alert_tests.unit_tests("../rules/wmwatch.rules.yml"), sort_keys=False)
    )
    result = promtool("test", "rules", tmp_path / "tests/t.yml")
    assert result.returncode != 0, change


def test_every_rule_has_severity_and_runbook_text() -> None:
    for group in read_yaml(DEPLOY / "prometheus/rules/wmwatch.rules.yml")["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"critical", "warning"}
            annotations = rule["annotations"]
            assert {"summary", "description", "runbook"} <= annotations.keys()
            assert len(annotations["runbook"]) > 80, rule["alert"]


def check_jsonschema(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "check-jsonschema"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("schema", "document"),
    [
        ("grafana-datasources", "grafana/provisioning/datasources/wmwatch.yml"),
        ("grafana-dashboards", "grafana/provisioning/dashboards/wmwatch.yml"),
        ("podmonitor", "k8s/podmonitor.yaml"),
        ("prometheusrule", "k8s/prometheusrule.yaml"),
    ],
)
def test_documents_match_their_schemas(schema: str, document: str) -> None:
    schema_path = DEPLOY / f"schemas/{schema}.schema.json"
    assert check_jsonschema("--check-metaschema", schema_path).returncode == 0
    result = check_jsonschema("--schemafile", schema_path, DEPLOY / document)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_schema_rejects_a_typo(tmp_path: Path) -> None:
    broken = read_yaml(DEPLOY / "k8s/podmonitor.yaml")
    broken["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    path = tmp_path / "podmonitor.yaml"
    path.write_text(yaml.safe_dump(broken))
    assert (
        check_jsonschema("--schemafile", DEPLOY / "schemas/podmonitor.schema.json", path).returncode
        == 1
    )


def test_compose_file_matches_the_compose_spec_and_its_mounts_exist() -> None:
    result = check_jsonschema("--builtin-schema", "vendor.compose-spec", DEPLOY / "compose.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    compose = read_yaml(DEPLOY / "compose.yaml")
    assert set(compose["services"]) == {"prometheus", "pushgateway", "grafana"}
    for service in compose["services"].values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (
                port
            )  # a local stack: never exposed beyond the host
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), source
    mounts = dict(
        v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith(".")
    )
    provider = read_yaml(DEPLOY / "grafana/provisioning/dashboards/wmwatch.yml")["providers"][0]
    assert mounts["../dashboards/json"] == provider["options"]["path"]
    home = compose["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    assert Path(home).parent.as_posix() == provider["options"]["path"]
    assert (ROOT / "dashboards/json" / Path(home).name).exists()


def test_prometheus_config_scrapes_wmwatch_and_the_pushgateway_with_its_labels() -> None:
    config = read_yaml(DEPLOY / "prometheus/prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["wmwatch"]["static_configs"][0]["targets"] == ["host.docker.internal:9108"]
    assert jobs["wmwatch-pushgateway"]["honor_labels"] is True
    datasource = read_yaml(DEPLOY / "grafana/provisioning/datasources/wmwatch.yml")["datasources"][
        0
    ]
    assert datasource["url"] == "http://prometheus:9090" and datasource["isDefault"] is True


def test_kubernetes_manifests_validate_and_select_the_same_driver_port() -> None:
    result = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "--quiet",
         str(DEPLOY / "k8s/service.yaml"), str(DEPLOY / "k8s/driver-pod-template.yaml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    service = read_yaml(DEPLOY / "k8s/service.yaml")
    pod = read_yaml(DEPLOY / "k8s/driver-pod-template.yaml")
    monitor = read_yaml(DEPLOY / "k8s/podmonitor.yaml")
    # Spark labels its driver pod spark-role=driver; the template adds the rest
    pod_labels = {**pod["metadata"]["labels"], "spark-role": "driver"}
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port_names = {
        p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]
    }
    assert port_names == {"wmwatch": 9108}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert pod["spec"]["containers"][0]["name"] == "spark-kubernetes-driver"


def test_ci_script_passes() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / ".ci/check_deploy.sh")],
        capture_output=True, text=True, timeout=300,
        env={"PATH": f"{BIN}:/usr/bin:/bin", "PYTHON": sys.executable},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "deploy checks passed" in result.stdout
