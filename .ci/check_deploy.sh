#!/usr/bin/env bash
# Checks the operational files: generated dashboards/rules are fresh, Prometheus config and rules
# pass promtool (check + unit tests), and compose/Kubernetes/Grafana files pass their schemas.
# Needs the Debian packages prometheus (promtool) and the venv's dev extras
# (check-jsonschema, kubernetes-validate, grafana-foundation-sdk, pyyaml).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
BIN="$(dirname "$(command -v "$PY")")"
command -v promtool >/dev/null || { echo "promtool missing: apt-get install -y prometheus" >&2; exit 1; }

echo "== generated files are up to date"
"$PY" -m dashboards --check

echo "== promtool"
promtool check config deploy/prometheus/prometheus.yml
promtool check rules deploy/prometheus/rules/*.yml
promtool test rules deploy/prometheus/tests/*.yml
# the PrometheusRule's spec is a rule file too
spec="$(mktemp --suffix=.yml)"
trap 'rm -f "$spec"' EXIT
"$PY" -c 'import sys, yaml; yaml.safe_dump(yaml.safe_load(open(sys.argv[1]))["spec"], open(sys.argv[2], "w"))' \
  deploy/k8s/prometheusrule.yaml "$spec"
promtool check rules "$spec"

echo "== schemas"
"$BIN/check-jsonschema" --check-metaschema deploy/schemas/*.schema.json
"$BIN/check-jsonschema" --builtin-schema vendor.compose-spec deploy/compose.yaml
"$BIN/check-jsonschema" --schemafile deploy/schemas/grafana-datasources.schema.json deploy/grafana/provisioning/datasources/*.yml
"$BIN/check-jsonschema" --schemafile deploy/schemas/grafana-dashboards.schema.json deploy/grafana/provisioning/dashboards/*.yml
"$BIN/check-jsonschema" --schemafile deploy/schemas/podmonitor.schema.json deploy/k8s/podmonitor.yaml
"$BIN/check-jsonschema" --schemafile deploy/schemas/prometheusrule.schema.json deploy/k8s/prometheusrule.yaml
"$BIN/kubernetes-validate" --strict --quiet deploy/k8s/service.yaml deploy/k8s/driver-pod-template.yaml
echo "deploy checks passed"
