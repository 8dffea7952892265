"""The Kubernetes manifests in deploy/k8s/: valid against Kubernetes' schemas, and consistent with each
other and with the project.

Schemas come from the `kubernetes-validate` package (they ship inside it: no network); without it those
tests skip. The cross-references need only PyYAML: selectors match the pods' labels, Services and probes
point at the containers' ports, every Deployment has an HPA, the router's stage addresses name the stages'
headless Services, and the ensembles ConfigMap holds exactly the files in ensembles/ (the optional folder of
YAML ensembles beside the model repository's own, which the model repository volume carries).

deploy/k8s/ensembles.yaml is generated from ensembles/; after changing a file there, regenerate it with

    python -m tests.deploy.test_k8s_manifests --write
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ENSEMBLES = ROOT / "ensembles"
#: The example model repository, which the model-repository volume holds, ensembles included.
REPOSITORY = ROOT / "model_repository"
CONFIGMAP_FILE = K8S / "ensembles.yaml"
CONFIGMAP_NAME = "pipeline-ensembles"
#: The oldest Kubernetes the manifests support (gRPC probes are GA from 1.27) and the newest schema shipped.
OLDEST_KUBERNETES = "1.27.0"

Doc = dict[str, Any]


def ensemble_files() -> list[Path]:
    return sorted(p for p in ENSEMBLES.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def render_configmap() -> str:
    """deploy/k8s/ensembles.yaml as it should be: every file in ensembles/, verbatim, as a ConfigMap."""
    lines = [
        "# Generated from ensembles/ by `python -m tests.deploy.test_k8s_manifests --write`; do not edit.",
        "# The router mounts it as its ensembles folder (PIPELINE_ENSEMBLES).",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        f"  name: {CONFIGMAP_NAME}",
        "  labels:",
        "    app.kubernetes.io/name: pipeline",
        "    app.kubernetes.io/component: router",
        "    app.kubernetes.io/part-of: pipeline",
        "data:" if ensemble_files() else "data: {}",
    ]
    for path in ensemble_files():
        text = path.read_text()
        block = "".join(f"    {line}" if line.strip() else "\n" for line in text.splitlines(keepends=True))
        if not block.endswith("\n"):
            block += "\n"
        lines.append(f"  {path.name}: |{'' if text.endswith(chr(10)) else '-'}")
        lines.append(block.rstrip("\n"))
        if yaml.safe_load(f"x: |\n{block}")["x"].rstrip("\n") != text.rstrip("\n"):
            # Text a literal block cannot carry (trailing spaces, tabs...): let PyYAML quote it.
            lines[-2:] = [f"  {yaml.safe_dump({path.name: text}, width=10**6).rstrip()}"]
    return "\n".join(lines) + "\n"


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load_docs() -> list[tuple[str, Doc]]:
    docs = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


DOCS = load_docs() if K8S.is_dir() else []


def of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def named(kind: str, name: str) -> Doc:
    found = [doc for doc in of_kind(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name!r}, found {len(found)}"
    return found[0]


def containers(deployment: Doc) -> list[Doc]:
    return deployment["spec"]["template"]["spec"]["containers"]


def env_of(container: Doc) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def container_port(container: Doc, port: int | str) -> int:
    """A container's port number by number or by name; fails if the container does not declare it."""
    for item in container.get("ports", []):
        if port in (item["containerPort"], item.get("name")):
            return item["containerPort"]
    raise AssertionError(f"container {container['name']!r} declares no port {port!r}")


def deployment_of_service(service: Doc) -> Doc:
    selector = service["spec"]["selector"]
    matches = [
        d
        for d in of_kind("Deployment")
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(matches) == 1, f"Service {service['metadata']['name']!r} selects {len(matches)} Deployments"
    return matches[0]


def stage_deployments() -> Iterator[Doc]:
    return (d for d in of_kind("Deployment") if d["metadata"]["name"] != "router")


# --- schemas ------------------------------------------------------------------------------------------


def test_manifests_exist() -> None:
    kinds = sorted({doc["kind"] for _, doc in DOCS})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "Service",
    ], kinds
    names = {d["metadata"]["name"] for d in of_kind("Deployment")}
    assert names == {"router", "preprocess", "model", "postprocess"}


def test_every_service_mounts_the_model_repository_read_only() -> None:
    (claim,) = of_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    for deployment in of_kind("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"], "readOnly": True}
        (container,) = pod["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts[volume["name"]]["mountPath"] == "/models" and mounts[volume["name"]]["readOnly"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PIPELINE_MODEL_DIR"] == "/models", deployment["metadata"]["name"]


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_manifests_match_kubernetes_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    if version == "latest":
        version = kubernetes_validate.latest_version()
    for source, doc in DOCS:
        try:
            # strict: unknown fields (typos) fail too
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{source}: {doc['kind']} {doc['metadata']['name']} (Kubernetes {version}): {err}")


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifest_files())


# --- cross-references -----------------------------------------------------------------------------------


def test_deployment_selectors_match_their_pod_labels() -> None:
    for deployment in of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), (
            f"Deployment {name}: selector {selector} vs labels {labels}"
        )
        others = [d for d in of_kind("Deployment") if d is not deployment]
        for other in others:
            assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items(), (
                f"Deployment {name}'s selector also selects {other['metadata']['name']}'s pods"
            )


def test_services_select_one_deployment_and_reach_its_port() -> None:
    for service in of_kind("Service"):
        deployment = deployment_of_service(service)
        (container,) = containers(deployment)
        for port in service["spec"]["ports"]:
            number = container_port(container, port.get("targetPort", port["port"]))
            assert number == port["port"], (
                f"Service {service['metadata']['name']}: port {port['port']} forwards to container port {number}"
            )


def test_every_stage_has_a_headless_service_named_like_it() -> None:
    for deployment in stage_deployments():
        name = deployment["metadata"]["name"]
        service = named("Service", name)
        assert service["spec"].get("clusterIP") == "None", (
            f"Service {name} must be headless (clusterIP: None) so DNS returns every pod to the router"
        )
        assert deployment_of_service(service) is deployment


def test_ports_agree_between_env_container_and_probes() -> None:
    for deployment in of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        (container,) = containers(deployment)
        env = env_of(container)
        port = int(env[f"PIPELINE_{name.upper()}_PORT"])
        assert container_port(container, "grpc") == port, f"{name}: containerPort vs PIPELINE_*_PORT"
        assert env.get("PIPELINE_HOST") == "0.0.0.0", f"{name}: must listen on every interface in a pod"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in container[probe], f"{name}: {probe} must use the gRPC health service"
            assert container_port(container, container[probe]["grpc"]["port"]) == port, (
                f"{name}: {probe} port"
            )


def test_every_pod_is_annotated_for_scraping_its_metrics_port() -> None:
    for deployment in of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        (container,) = containers(deployment)
        port = int(env_of(container)[f"PIPELINE_{name.upper()}_METRICS_PORT"])
        assert container_port(container, "metrics") == port, f"{name}: metrics containerPort vs env"
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", f"{name}: pods are not marked for scraping"
        assert annotations.get("prometheus.io/port") == str(port), f"{name}: prometheus.io/port"
        assert annotations.get("prometheus.io/path") == "/metrics", f"{name}: prometheus.io/path"
        service = named("Service", name)
        assert port in {p["port"] for p in service["spec"]["ports"]}, f"Service {name} has no metrics port"


def test_every_deployment_has_an_hpa_with_cpu_requests_to_scale_on() -> None:
    hpas = {hpa["spec"]["scaleTargetRef"]["name"]: hpa for hpa in of_kind("HorizontalPodAutoscaler")}
    for deployment in of_kind("Deployment"):
        name = deployment["metadata"]["name"]
        assert name in hpas, f"Deployment {name} has no HorizontalPodAutoscaler"
        spec = hpas[name]["spec"]
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert spec["scaleTargetRef"]["apiVersion"] == deployment["apiVersion"]
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        assert "replicas" not in deployment["spec"], f"Deployment {name}: the HPA owns replicas"
        (container,) = containers(deployment)
        assert "cpu" in container["resources"]["requests"], f"{name}: CPU utilisation needs a CPU request"
    assert set(hpas) <= {d["metadata"]["name"] for d in of_kind("Deployment")}, "an HPA targets nothing"


ADAPTER_VALUES = K8S / "autoscaling" / "prometheus-adapter-values.yaml"


def test_stages_scale_on_the_routers_queue_for_their_own_models() -> None:
    """Each stage's HPA scales on external metrics the adapter's rules define, selecting exactly the models
    the ensembles run on that stage; the rules read only series the router exports."""
    from pipeline.ensemble.catalog import ensemble_plans
    from pipeline.runtime.repository import ModelRepository
    from pipeline.stage.placement import PYTHON_SERVICES, python_models_of

    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["external"]
    defined = {rule["name"]["as"]: rule for rule in rules}
    exported = set(
        re.findall(r"`(pipeline_\w+)`", (ROOT / "pipeline" / "runtime" / "metrics.py").read_text())
    )
    for rule in rules:
        for series in re.findall(
            r"\b(pipeline_\w+?)(?:_sum|_count)?\{", rule["metricsQuery"] + rule["seriesQuery"]
        ):
            assert series in exported, (
                f"adapter rule {rule['name']['as']} reads {series}, which nothing exports"
            )
    models_of: dict[str, set[str]] = {}
    plans = ensemble_plans([ENSEMBLES], repository=REPOSITORY)
    # A config.pbtxt ensemble's steps name no stage: its Python models go where the services place them.
    placed = {
        name: service
        for service in PYTHON_SERVICES
        for name in python_models_of(service, ModelRepository(REPOSITORY), plans)
    }
    for plan in plans:
        for step in plan.steps:
            stage = step.stage or placed.get(step.model_name, "model")
            models_of.setdefault(stage, set()).add(step.model_name)
    hpas = {hpa["spec"]["scaleTargetRef"]["name"]: hpa for hpa in of_kind("HorizontalPodAutoscaler")}
    for stage, models in models_of.items():
        metrics = hpas[stage]["spec"]["metrics"]
        names = set()
        for metric in metrics:
            assert metric["type"] == "External", (
                f"{stage}: scales on {metric['type']}, not the router's queue"
            )
            name, selector = metric["external"]["metric"]["name"], metric["external"]["metric"]["selector"]
            assert name in defined, f"{stage}: no adapter rule serves {name}"
            names.add(name)
            if "matchExpressions" in selector:
                (expression,) = selector["matchExpressions"]
                assert expression["key"] == "model" and expression["operator"] == "In"
                assert set(expression["values"]) == models, (
                    f"{stage}: {name} selects other models than its own"
                )
            else:
                assert selector["matchLabels"] == {"stage": stage}
        assert names == {"pipeline_queue_seconds", "pipeline_queue_depth", "pipeline_stage_inflight_calls"}


def test_configmap_is_generated_from_the_ensemble_files() -> None:
    assert CONFIGMAP_FILE.read_text() == render_configmap(), (
        "deploy/k8s/ensembles.yaml is out of date with ensembles/: "
        "run `python -m tests.deploy.test_k8s_manifests --write`"
    )
    configmap = named("ConfigMap", CONFIGMAP_NAME)
    assert sorted(configmap["data"]) == [p.name for p in ensemble_files()]
    for path in ensemble_files():
        assert configmap["data"][path.name].rstrip("\n") == path.read_text().rstrip("\n"), path.name


def test_router_mounts_the_ensembles_and_reaches_every_stage(tmp_path: Path) -> None:
    from pipeline.ensemble.catalog import load_catalog

    router = named("Deployment", "router")
    (container,) = containers(router)
    env = env_of(container)
    pod = router["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == CONFIGMAP_NAME)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert env["PIPELINE_ENSEMBLES"] == mount["mountPath"]

    # The ensembles as the router will read them: the ConfigMap's files and the example repository's (the
    # model-repository volume holds them), expanded with the pod's env.
    texts = dict(named("ConfigMap", CONFIGMAP_NAME)["data"] or {})
    texts |= {str(path): path.read_text() for path in sorted(REPOSITORY.glob("*/ensemble.yaml"))}
    assert texts, "no ensemble to check"
    for key, text in (named("ConfigMap", CONFIGMAP_NAME)["data"] or {}).items():
        (tmp_path / key).write_text(text)
    for key, text in texts.items():
        for variable in re.findall(r"\$\{(\w+)", text):
            assert variable in env, f"ensemble {key} reads ${{{variable}}}, which the router pod does not set"
    catalog = load_catalog([tmp_path], repository=REPOSITORY, environ=env)
    for key, endpoint in catalog.stages.items():
        match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", endpoint.address)
        assert match, f"stage {key}: address {endpoint.address!r} is not a dns:/// target of a Service"
        service = named("Service", match.group(1))
        assert service["spec"].get("clusterIP") == "None", f"stage {key}: {service} must be headless"
        assert int(match.group(2)) in {p["port"] for p in service["spec"]["ports"]}, (
            f"stage {key}: Service {match.group(1)} has no port {match.group(2)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="Check or regenerate deploy/k8s/ensembles.yaml.")
    parser.add_argument("--write", action="store_true", help="regenerate it from ensembles/")
    args = parser.parse_args()
    if args.write:
        CONFIGMAP_FILE.write_text(render_configmap())
        print(f"wrote {CONFIGMAP_FILE.relative_to(ROOT)} from {len(ensemble_files())} ensemble file(s)")
    elif CONFIGMAP_FILE.read_text() != render_configmap():
        sys.exit(f"{CONFIGMAP_FILE.relative_to(ROOT)} is out of date: run with --write")


if __name__ == "__main__":
    main()


# --- readiness, disruptions, network policies, the engine cache ------------------------------------------


def test_the_router_is_ready_on_its_inference_service_and_alive_on_the_empty_one() -> None:
    from pipeline.runtime.server import INFERENCE_SERVICE

    (container,) = containers(named("Deployment", "router"))
    assert container["readinessProbe"]["grpc"].get("service") == INFERENCE_SERVICE
    # "" is liveness: SERVING while the router waits for a stage, so it is not restarted for that.
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    assert container["startupProbe"]["grpc"].get("service", "") == ""


def test_every_stage_has_a_disruption_budget_of_one_pod() -> None:
    budgets = of_kind("PodDisruptionBudget")
    for deployment in stage_deployments():
        name = deployment["metadata"]["name"]
        mine = [
            b
            for b in budgets
            if b["spec"]["selector"]["matchLabels"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(mine) == 1, f"Deployment {name}: {len(mine)} PodDisruptionBudgets select its pods"
        # maxUnavailable (not minAvailable: 1) still lets a drain evict a stage's single replica.
        assert mine[0]["spec"] == {**mine[0]["spec"], "maxUnavailable": 1}
        assert "minAvailable" not in mine[0]["spec"]
    assert len(budgets) == len(list(stage_deployments()))


def _labels(deployment: Doc) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a set of labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


#: The namespace the manifests are applied in, with the label Kubernetes sets on every namespace.
HERE = {"kubernetes.io/metadata.name": "pipeline"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def allowed(source: dict[str, str], namespace: dict[str, str], target: Doc, port: int) -> bool:
    """Whether the NetworkPolicies let a pod labelled `source` in `namespace` reach `target`'s pods on
    `port`, as Kubernetes evaluates them (ingress; no policy selecting the pods: everything is allowed)."""
    policies = [p for p in of_kind("NetworkPolicy") if _selects(p["spec"]["podSelector"], _labels(target))]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            for peer in rule.get("from", []):
                in_namespace = (
                    _selects(peer["namespaceSelector"], namespace)
                    if "namespaceSelector" in peer
                    else namespace == HERE
                )
                if in_namespace and _selects(peer.get("podSelector", {}), source):
                    return True
    return False


def test_stages_take_inference_from_routers_scrapes_from_prometheus_and_control_from_admins() -> None:
    router = _labels(named("Deployment", "router"))
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    admin = {"pipeline-repository-admin": "true", "app": "load-a-model"}
    anyone = {"app": "something-else"}
    for deployment in stage_deployments():
        name = deployment["metadata"]["name"]
        (container,) = containers(deployment)
        grpc_port = container_port(container, "grpc")
        # A stage serves /metrics where its environment says, else on its gRPC port + 100 (pipeline.server).
        metrics_port = int(env_of(container).get(f"PIPELINE_{name.upper()}_METRICS_PORT", grpc_port + 100))
        assert allowed(router, HERE, deployment, grpc_port), f"{name}: the router cannot reach it"
        assert not allowed(anyone, HERE, deployment, grpc_port), f"{name}: any pod may call it"
        assert not allowed(router, MONITORING, deployment, grpc_port), (
            f"{name}: a router-labelled pod elsewhere"
        )
        assert allowed(prometheus, MONITORING, deployment, metrics_port), f"{name}: Prometheus cannot scrape"
        assert not allowed(prometheus, MONITORING, deployment, grpc_port), f"{name}: Prometheus may infer"
        assert not allowed(prometheus, HERE, deployment, metrics_port), (
            f"{name}: any 'prometheus' pod scrapes"
        )
        assert not allowed(anyone, HERE, deployment, metrics_port), f"{name}: any pod may scrape"
        assert allowed(admin, HERE, deployment, grpc_port), f"{name}: its repository cannot be controlled"
    # Clients reach the router from anywhere.
    assert allowed(anyone, {"kubernetes.io/metadata.name": "elsewhere"}, named("Deployment", "router"), 8001)


def test_the_model_service_caches_engines_on_a_writable_volume() -> None:
    model = named("Deployment", "model")
    (container,) = containers(model)
    cache = env_of(container)["PIPELINE_ENGINE_CACHE"]
    mount = next((m for m in container["volumeMounts"] if m["mountPath"] == cache), None)
    assert mount is not None, (
        "PIPELINE_ENGINE_CACHE is not a mounted volume (the root file system is read-only)"
    )
    assert not mount.get("readOnly", False)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volume = next(v for v in model["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume


def test_compose_gives_the_engine_cache_a_writable_volume_and_every_service_its_tokens() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    model = services["model"]
    cache = model["environment"]["PIPELINE_ENGINE_CACHE"]
    # SOURCE:TARGET[:MODE], where SOURCE may be ${VAR:-default}
    mounts = {re.sub(r"\$\{[^}]*\}", "volume", v).split(":")[1]: v for v in model["volumes"]}
    assert cache in mounts and not mounts[cache].endswith(":ro"), mounts
    assert mounts["/models"].endswith(":ro")
    # With tokens set, the router calls the stages with its own token, which the stages take.
    for name, service in services.items():
        if service.get("profiles") or "healthcheck" not in service:
            continue  # Prometheus, the one-shot model-repository writer: no inference service
        assert "PIPELINE_STAGE_TOKEN" in service["environment"], name
        assert "PIPELINE_ADMIN_TOKENS" in service["environment"], name
    assert "PIPELINE_AUTH_TOKENS" in services["router"]["environment"]
