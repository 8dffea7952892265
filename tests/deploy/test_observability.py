"""The observability profile, checked offline: Compose, Prometheus' configuration and the Grafana
dashboard agree with each other and with the metrics the servers export.

CI (scripts/ci-docker.sh) checks the same things live: every target up, replicas included, and every
dashboard query returning data during a bench run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from pipeline.runtime.metrics import TRITON_COUNTERS, TRITON_PENDING, Metrics

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "pipeline.json"
PIPELINE_SERVICES = {"router", "preprocess", "model", "postprocess"}


def compose(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def prometheus_jobs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load((OBSERVABILITY / "prometheus" / "prometheus.yml").read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def metrics_port(service: dict[str, Any], name: str) -> int:
    return int(service["environment"][f"PIPELINE_{name.upper()}_METRICS_PORT"])


def test_prometheus_discovers_every_replica_of_every_service_on_its_metrics_port() -> None:
    services = compose("compose.yaml")["services"]
    jobs = prometheus_jobs()
    assert set(jobs) == PIPELINE_SERVICES | {"prometheus"}
    for name in PIPELINE_SERVICES:
        port = metrics_port(services[name], name)
        assert str(port) in services[name]["expose"], f"{name}: metrics port {port} not exposed"
        # DNS service discovery on the service's name: one target per replica, however many there are.
        (sd,) = jobs[name]["dns_sd_configs"]
        assert sd["names"] == [name] and sd["type"] == "A" and sd["port"] == port, (name, sd)
        assert "static_configs" not in jobs[name], f"{name}: a static target would miss replicas"


def test_prometheus_is_in_the_observability_profile_and_built_here() -> None:
    services = compose("compose.yaml")["services"]
    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["observability"]
    assert prometheus["build"]["context"] == "observability/prometheus"
    assert prometheus["pull_policy"] == "build"
    # Reaches the stages (internal network) and publishes its UI (edge).
    assert set(prometheus["networks"]) == {"stages", "edge"}
    assert not set(services) & {"grafana", "jaeger"}, "images from a registry stay out of compose.yaml"
    assert all("profiles" not in services[name] for name in PIPELINE_SERVICES)


def test_grafana_and_jaeger_come_from_the_override_file_in_the_same_profile() -> None:
    services = compose("compose.observability.yaml")["services"]
    for name in ("grafana", "jaeger"):
        assert services[name]["profiles"] == ["observability"], name
        assert "build" not in services[name] and services[name]["image"], name
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in services["grafana"]["volumes"]}
    provider = yaml.safe_load(
        (OBSERVABILITY / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml").read_text()
    )["providers"][0]
    assert mounts[provider["options"]["path"]] == "./observability/grafana/dashboards"
    for name in PIPELINE_SERVICES:  # every service sends its spans to Jaeger
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"


def _exported_names() -> set[str]:
    """Every series name a server's /metrics can hold, as PromQL sees it."""
    metrics = Metrics()
    metrics.gauge("pipeline_queue_depth", "", "model", list)
    names = {"up"}
    for family in metrics.registry.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names |= {family.name, *(sample.name for sample in family.samples)}
    return names | {name for name, _, _ in TRITON_COUNTERS} | {TRITON_PENDING[0]}


def _metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers left once label matchers, groupings and
    ranges are gone, other than function calls."""
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)", "", expr)
    return set(re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\b(?!\s*\()", bare))


def test_every_dashboard_query_reads_metrics_the_servers_export() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    sources = yaml.safe_load(
        (OBSERVABILITY / "grafana" / "provisioning" / "datasources" / "datasources.yaml").read_text()
    )["datasources"]
    prometheus_uid = next(s["uid"] for s in sources if s["type"] == "prometheus")
    exported = _exported_names()
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert len(set(titles)) == len(titles)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == prometheus_uid, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, target["expr"]
            assert names <= exported, f"panel {panel['title']!r}: unknown metrics {names - exported}"
    # What the issue asks the dashboard to show, per stage.
    text = " ".join(titles).lower()
    for wanted in ("throughput", "latency", "queue time", "batch size"):
        assert wanted in text, wanted
