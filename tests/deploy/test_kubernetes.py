"""deploy/kubernetes: schema-valid manifests that agree with each other and with the real CLI.

What is checked, offline (no cluster, no kubectl):

- Every built-in object validates with kubernetes-validate against the
  Kubernetes 1.30 OpenAPI schemas in strict mode (unknown fields fail).
- The ServiceMonitor is a CRD kubernetes-validate has no schema for. It is
  checked against SERVICE_MONITOR_SCHEMA below: the fields this repository
  uses, with the types, enums and patterns of the Prometheus Operator's
  monitoring.coreos.com/v1 CRD, and no other fields allowed. It is not the
  whole CRD, so a field we do not use is rejected even where the CRD has it.
- kustomization.yaml lists every manifest in the folder, and only those.
- The ConfigMap's clusterwatch.toml, the containers' args and env go through
  clusterwatch's own config loader and argument parser, so every key, flag
  and variable is a real setting; the resulting paths and ports are the
  mounted volumes, the container ports and the Service's ports.
- The cross-references: selectors, service accounts, the RBAC the kubernetes
  launcher needs and no more, and the security settings the agent relies on.
- What a real Prometheus stores from the ServiceMonitor's scrape (its
  honorLabels and relabelings, rendered as the Prometheus Operator does):
  a GPU's series keep the training pod's labels, not the coordinator's.
"""

from __future__ import annotations

import contextlib
import copy
import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import threading
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import jsonschema
import kubernetes_validate
import kustomize
import psutil
import pytest
import yaml
from helpers import ROOT, Cluster, tls_credentials, tls_flags, wait_for
from prometheus_server import require

from clusterwatch import config
from clusterwatch.agent.runtime import AGENT_CONNECTED
from clusterwatch.cli import build_parser, certs
from clusterwatch.cli.common import settings_from_args
from clusterwatch.exposition.node_metrics import NODE_UP, write_node, write_node_info
from clusterwatch.exposition.promtext import Exposition
from clusterwatch.runtime.cert_terms import Role
from clusterwatch.runtime.etcd import parse_endpoints
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc, node_pb2

pytestmark = pytest.mark.timeout(60)

MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"
NAMESPACE = "clusterwatch"
NODE_NAME = "gpu-node-7"  # what the agent's spec.nodeName fieldRef resolves to in these checks
POD_NAME = "clusterwatch-coordinator-1"  # and a coordinator's (or etcd member's) metadata.name
FIELDS = {"spec.nodeName": NODE_NAME, "metadata.name": POD_NAME}

Doc = dict[str, Any]
S = TypeVar("S")


GROUP = MANIFESTS / "several-coordinators"
COMPONENT = MANIFESTS / "hardware-series-agents"

DOCUMENTS = kustomize.build(MANIFESTS)  # one coordinator, the default
GROUP_DOCUMENTS = kustomize.build(GROUP, MANIFESTS)  # several coordinators and an etcd


def find(kind: str, name: str, documents: list[tuple[str, Doc]] = DOCUMENTS) -> Doc:
    (doc,) = [d for _, d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def find_group(kind: str, name: str) -> Doc:
    return find(kind, name, GROUP_DOCUMENTS)


def doc_id(item: tuple[str, Doc]) -> str:
    path, doc = item
    return f"{path}:{doc['kind']}/{doc['metadata']['name']}"


# Each object once, whichever of the two builds has it.
BUILT_IN = list(
    {
        doc_id(item): item
        for item in DOCUMENTS + GROUP_DOCUMENTS
        if item[1]["apiVersion"] != "monitoring.coreos.com/v1"
    }.values()
)


@pytest.mark.parametrize("item", BUILT_IN, ids=doc_id)
def test_manifest_validates_strictly_against_the_kubernetes_schema(item: tuple[str, Doc]) -> None:
    _, doc = item
    assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The validator really is strict: a misspelt field fails (so the test above can fail)."""
    daemonset = copy.deepcopy(find("DaemonSet", "clusterwatch-agent"))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


# --- ServiceMonitor ----------------------------------------------------------

_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_LABEL_NAME = {"type": "string", "pattern": r"^[a-zA-Z_][a-zA-Z0-9_]*$"}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABEL_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "action": {
            "enum": [
                "replace",
                "Replace",
                "keep",
                "Keep",
                "drop",
                "Drop",
                "hashmod",
                "HashMod",
                "labelmap",
                "LabelMap",
                "labeldrop",
                "LabelDrop",
                "labelkeep",
                "LabelKeep",
                "lowercase",
                "Lowercase",
                "uppercase",
                "Uppercase",
                "keepequal",
                "KeepEqual",
                "dropequal",
                "DropEqual",
            ]
        },
        "regex": {"type": "string"},
        "replacement": {"type": "string"},
        "separator": {"type": "string"},
        "sourceLabels": {"type": "array", "items": _LABEL_NAME},
        "targetLabel": {"type": "string"},
    },
}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": _RELABEL_CONFIG},
        "metricRelabelings": {"type": "array", "items": _RELABEL_CONFIG},
    },
}


def monitor_schema(kind: str, endpoints: str) -> Doc:
    """The monitoring.coreos.com/v1 ServiceMonitor or PodMonitor fields this repository uses, as the CRD types them."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "namespace"],
                "properties": {
                    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                    "namespace": {"type": "string"},
                    "labels": _STRING_MAP,
                },
            },
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": [endpoints, "selector"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STRING_MAP},
                    },
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "any": {"type": "boolean"},
                            "matchNames": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                    endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


SERVICE_MONITOR_SCHEMA = monitor_schema("ServiceMonitor", "endpoints")
POD_MONITOR_SCHEMA = monitor_schema("PodMonitor", "podMetricsEndpoints")


def duration_s(text: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    assert text[-1] in units, text
    assert text[:-1].isdigit(), text
    return int(text[:-1]) * units[text[-1]]


def test_service_monitor_matches_the_crd_fields_it_uses_and_the_service() -> None:
    monitor = find("ServiceMonitor", "clusterwatch-coordinator")
    jsonschema.Draft202012Validator(SERVICE_MONITOR_SCHEMA).validate(monitor)
    assert monitor["metadata"]["namespace"] == NAMESPACE
    service = find("Service", "clusterwatch-coordinator")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert duration_s(endpoint["scrapeTimeout"]) <= duration_s(endpoint["interval"])
        # The coordinator's own node/job/pod labels must win over the target's.
        assert endpoint["honorLabels"] is True


def test_pod_monitor_scrapes_every_agents_metrics_port() -> None:
    monitor = find("PodMonitor", "clusterwatch-agent")
    jsonschema.Draft202012Validator(POD_MONITOR_SCHEMA).validate(monitor)
    assert monitor["metadata"]["namespace"] == NAMESPACE
    daemonset = find("DaemonSet", "clusterwatch-agent")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    )
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert container_port(container, endpoint["port"])
        assert endpoint["path"] == "/metrics"
        assert duration_s(endpoint["scrapeTimeout"]) <= duration_s(endpoint["interval"])
        assert endpoint["honorLabels"] is True  # a GPU's training pod labels win over the agent pod's


def test_service_monitor_schema_rejects_an_unknown_field() -> None:
    monitor = copy.deepcopy(find("ServiceMonitor", "clusterwatch-coordinator"))
    monitor["spec"]["endpoints"][0]["honourLabels"] = True
    with pytest.raises(jsonschema.ValidationError, match="honourLabels"):
        jsonschema.Draft202012Validator(SERVICE_MONITOR_SCHEMA).validate(monitor)


# --- kustomization -------------------------------------------------------------


def test_the_two_kustomizations_use_every_manifest_once_and_name_every_image() -> None:
    on_disk = {str(p.relative_to(MANIFESTS)) for p in MANIFESTS.rglob("*.y*ml")} - {
        str(p.relative_to(MANIFESTS)) for p in MANIFESTS.rglob("kustomization.yaml")
    }
    single = [path for path, _ in DOCUMENTS]
    group = [path for path, _ in GROUP_DOCUMENTS]
    assert set(single) | set(group) == on_disk
    assert {p for p in single if p.startswith("base/")} == {p for p in group if p.startswith("base/")}
    for folder, documents in ((MANIFESTS, DOCUMENTS), (GROUP, GROUP_DOCUMENTS)):
        spec = kustomize.kustomization(folder)
        assert (spec["apiVersion"], spec["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
        # No namespace transformer: it would move the Role in the jobs' namespace.
        assert "namespace" not in spec
        # The component, offered commented out, names the folder that is one.
        relative = os.path.relpath(COMPONENT, folder)
        assert f"# components:\n#   - {relative}\n" in (folder / "kustomization.yaml").read_text()
        images = {image["name"] for image in spec["images"]}
        used = {c["image"].rsplit(":", 1)[0] for c in containers(documents)}
        assert used == images
    assert kustomize.kustomization(COMPONENT)["kind"] == "Component"


@pytest.mark.parametrize("folder", [MANIFESTS, GROUP], ids=["one-coordinator", "several-coordinators"])
@pytest.mark.parametrize("with_the_component", [False, True], ids=["", "hardware-series-agents"])
def test_the_kustomizations_build_as_kubectl_builds_them(
    folder: Path, with_the_component: bool, tmp_path: Path
) -> None:
    """tests/kustomize.py, which every test here reads the manifests through, agrees with the real
    kustomize in kubectl, object by object (where kubectl is installed; it needs no cluster)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the offline build is not compared with kustomize's")
    copied = tmp_path / "kubernetes"
    shutil.copytree(MANIFESTS, copied)
    where = copied / folder.relative_to(MANIFESTS)
    if with_the_component:
        spec_path = where / "kustomization.yaml"
        text = spec_path.read_text()
        relative = os.path.relpath(COMPONENT, folder)
        spec_path.write_text(
            text.replace(f"# components:\n#   - {relative}\n", f"components:\n  - {relative}\n")
        )
    ours = kustomize.build(where)
    printed = subprocess.run(
        ["kubectl", "kustomize", str(where)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    theirs = [doc for doc in yaml.safe_load_all(printed) if doc]

    def keyed(docs: list[Doc]) -> dict[str, str]:
        return {f"{d['kind']}/{d['metadata']['name']}": json.dumps(d, sort_keys=True) for d in docs}

    assert keyed([doc for _, doc in ours]) == keyed(theirs)
    if with_the_component:
        assert (
            '"CLUSTERWATCH_COORDINATOR_HARDWARE_SERIES"'
            in keyed(theirs)[f"{'StatefulSet' if folder == GROUP else 'Deployment'}/clusterwatch-coordinator"]
        )


# --- the manifests agree with each other and with clusterwatch's settings ------


def containers(documents: list[tuple[str, Doc]] = DOCUMENTS) -> Iterator[Doc]:
    for _, doc in documents:
        if doc["kind"] in {"Deployment", "DaemonSet", "StatefulSet"}:
            yield from doc["spec"]["template"]["spec"]["containers"]


def test_namespaced_objects_live_in_clusterwatch_except_the_jobs_pod_role() -> None:
    jobs_namespace = config_tables()["recovery"]["kubernetes_namespace"]
    for _, doc in DOCUMENTS:
        if doc["kind"] in {"Namespace", "ClusterRole", "ClusterRoleBinding"}:
            assert "namespace" not in doc["metadata"], doc["metadata"]["name"]
        elif doc["kind"] in {"Role", "RoleBinding"}:
            assert doc["metadata"]["namespace"] == jobs_namespace
        else:
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]


def config_tables() -> dict[str, Any]:
    return tomllib.loads(find("ConfigMap", "clusterwatch-config")["data"]["clusterwatch.toml"])


def test_config_file_is_valid_for_every_section() -> None:
    tables = config_tables()
    assert set(tables) <= set(config.SECTIONS.values())
    for cls, section in config.SECTIONS.items():
        if section in tables:
            config.load(cls, file_tables=tables, file_name="configmap.yaml", environ={})


def expand(value: str, defined: dict[str, str]) -> str:
    """``value`` with ``$(NAME)`` of each variable defined above it replaced, as the kubelet does."""
    return re.sub(r"\$\((\w+)\)", lambda m: defined.get(m[1], m[0]), value)


def container_env(container: Doc) -> dict[str, str]:
    """The container's environment as the kubelet gives it (the downward API as FIELDS say)."""
    defined: dict[str, str] = {}
    for env in container.get("env", []):
        if "valueFrom" in env:
            defined[env["name"]] = FIELDS[env["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            defined[env["name"]] = expand(env["value"], defined)
    return defined


def container_settings(
    workload: Doc,
    cls: type[S],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: list[str] | None = None,
) -> S:
    """The settings the container's command line (or ``command``, e.g. a hook's), environment
    and mounted config file give."""
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    if command is None:
        assert container["command"] == ["clusterwatch"]
        command = ["clusterwatch", *container["args"]]
    assert command[0] == "clusterwatch"
    args = command[1:]
    config_path = Path(args[args.index("--config") + 1])
    config_volume = mount_source(workload, container, config_path.parent)
    assert config_volume["configMap"]["name"] == "clusterwatch-config"
    local_config = tmp_path / config_path.name
    local_config.write_text(find("ConfigMap", "clusterwatch-config")["data"][config_path.name])
    args[args.index("--config") + 1] = str(local_config)
    for name in [n for n in os.environ if n.startswith(config.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in container_env(container).items():
        monkeypatch.setenv(name, value)
    parsed = build_parser().parse_args(args)
    # Every CLUSTERWATCH_* variable the container sets is a setting or the log level.
    known = {config.env_name(s, f.name) for c, s in config.SECTIONS.items() for f in config.fields_of(c)}
    for env in container.get("env", []):
        if env["name"].startswith(config.ENV_PREFIX):
            assert env["name"] in known | {"CLUSTERWATCH_LOG_LEVEL"}, env["name"]
    return settings_from_args(parsed, cls)


def mount_source(workload: Doc, container: Doc, path: Path) -> Doc:
    """The volume mounted at ``path`` (exactly) in ``container``."""
    (mount,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == path]
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    volume: Doc = volumes[mount["name"]]
    return volume


def container_port(container: Doc, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def test_agent_settings_come_from_the_daemonset_and_point_at_its_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemonset = find("DaemonSet", "clusterwatch-agent")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    settings = container_settings(daemonset, config.AgentSettings, tmp_path, monkeypatch)
    assert settings.resolved_node_id == NODE_NAME
    service = find("Service", "clusterwatch-coordinator")
    host, port = config.split_host_port(settings.coordinator)
    assert host == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert port in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
    assert settings.gpu_backend == "auto"
    # Every path the agent uses is the host's, through a hostPath volume.
    socket_dir = mount_source(daemonset, container, Path(settings.socket).parent)
    assert socket_dir["hostPath"]["path"] == "/run/clusterwatch"
    pod_resources = mount_source(daemonset, container, Path(settings.pod_resources_socket).parent)
    assert pod_resources["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert mount_source(daemonset, container, settings.sys_root)["hostPath"]["path"] == "/sys"
    assert settings.proc_root == Path("/proc")  # the host's, through hostPID
    # Mutual TLS with this node's own certificate, from the node-certificates Secret.
    assert settings.tls_cert == f"/etc/clusterwatch-tls/{NODE_NAME}.crt"
    for path in (settings.tls_cert, settings.tls_key, settings.tls_ca):
        assert mount_source(daemonset, container, Path(path).parent)["secret"]["secretName"]
    _, metrics_port = config.split_host_port(settings.metrics_listen)
    assert metrics_port == container_port(container, "metrics")
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"


def test_coordinator_settings_come_from_the_deployment_and_match_the_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment = find("Deployment", "clusterwatch-coordinator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    settings = container_settings(deployment, config.CoordinatorSettings, tmp_path, monkeypatch)
    recovery = container_settings(deployment, config.RecoverySettings, tmp_path, monkeypatch)
    state = mount_source(deployment, container, settings.state_dir)
    assert state["persistentVolumeClaim"]["claimName"] == "clusterwatch-coordinator-state"
    find("PersistentVolumeClaim", "clusterwatch-coordinator-state")
    service = find("Service", "clusterwatch-coordinator")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    for name, address in (("grpc", settings.listen), ("metrics", settings.metrics_listen)):
        _, port = config.split_host_port(address)
        assert port == container_port(container, name)
        assert ports[name]["targetPort"] == name
    # The kubelet's gRPC probe has no client certificate: readiness is /healthz.
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    for path in (settings.tls_cert, settings.tls_key, settings.tls_ca, settings.admin_token_file):
        assert mount_source(deployment, container, Path(path).parent)["secret"]["secretName"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert recovery.launcher == "kubernetes"


def test_agent_sees_the_host_and_every_gpu_without_taking_one() -> None:
    pod = find("DaemonSet", "clusterwatch-agent")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    resources = container["resources"]
    assert not any("nvidia.com" in key for part in resources.values() for key in part)
    security = container["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    assert security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False
    assert security["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/host/sys"]["readOnly"] is True
    assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["automountServiceAccountToken"] is False


def test_coordinator_runs_as_one_unprivileged_replica() -> None:
    deployment = find("Deployment", "clusterwatch-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_rbac_grants_the_kubernetes_launcher_what_kubectl_needs_and_no_more() -> None:
    accounts = {d["metadata"]["name"] for _, d in DOCUMENTS if d["kind"] == "ServiceAccount"}
    for kind, name in (("DaemonSet", "clusterwatch-agent"), ("Deployment", "clusterwatch-coordinator")):
        assert find(kind, name)["spec"]["template"]["spec"]["serviceAccountName"] in accounts
    granted: set[tuple[str, str, str]] = set()
    for _, binding in DOCUMENTS:
        if binding["kind"] not in {"RoleBinding", "ClusterRoleBinding"}:
            continue
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "clusterwatch-coordinator", "namespace": NAMESPACE}
        ]
        role = find(binding["roleRef"]["kind"], binding["roleRef"]["name"])
        if role["kind"] == "Role":
            assert role["metadata"]["namespace"] == binding["metadata"]["namespace"]
        scope = role["metadata"].get("namespace", "cluster")
        for rule in role["rules"]:
            assert rule["apiGroups"] == [""]
            granted |= {(scope, res, verb) for res in rule["resources"] for verb in rule["verbs"]}
    jobs_namespace = config_tables()["recovery"]["kubernetes_namespace"]
    assert granted == {
        ("cluster", "nodes", "get"),  # kubectl cordon reads the node,
        ("cluster", "nodes", "patch"),  # then sets spec.unschedulable
        (jobs_namespace, "pods", "list"),  # kubectl delete pod --selector lists the job's pods,
        (jobs_namespace, "pods", "delete"),  # then deletes each
    }


# --- the hardware-series-agents component --------------------------------------


def with_component(kind: str, name: str, documents: list[tuple[str, Doc]] = DOCUMENTS) -> Doc:
    """The object as ``kubectl apply -k`` makes it with the component enabled."""
    patches = kustomize.kustomization(COMPONENT)["patches"]
    doc = find(kind, name, documents)
    for patch in patches:
        if kustomize.matches(patch["target"], doc):
            doc = kustomize.json_patch(doc, yaml.safe_load(patch["patch"]))
    return doc


@pytest.mark.parametrize(
    ("documents", "kind"),
    [(DOCUMENTS, "Deployment"), (GROUP_DOCUMENTS, "StatefulSet")],
    ids=["one-coordinator", "several-coordinators"],
)
def test_the_component_switches_the_coordinator_and_the_pod_monitor_to_agents(
    documents: list[tuple[str, Doc]], kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched = [
        f"{doc['kind']}/{doc['metadata']['name']}"
        for _, doc in documents
        if any(kustomize.matches(p["target"], doc) for p in kustomize.kustomization(COMPONENT)["patches"])
    ]
    assert sorted(patched) == sorted([f"{kind}/clusterwatch-coordinator", "PodMonitor/clusterwatch-agent"])
    default = find(kind, "clusterwatch-coordinator", documents)
    lean = with_component(kind, "clusterwatch-coordinator", documents)
    settings = container_settings(default, config.CoordinatorSettings, tmp_path, monkeypatch)
    assert settings.hardware_series == "coordinator"
    settings = container_settings(lean, config.CoordinatorSettings, tmp_path, monkeypatch)
    assert settings.hardware_series == "agents"
    assert kubernetes_validate.validate(lean, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION
    jsonschema.Draft202012Validator(POD_MONITOR_SCHEMA).validate(
        with_component("PodMonitor", "clusterwatch-agent", documents)
    )


# --- what Prometheus stores from the monitors' scrapes -------------------------


def scrape_config_from(monitor: Doc, target: str, target_labels: dict[str, str]) -> Doc:
    """The scrape job the Prometheus Operator renders for the monitor's first endpoint.

    The operator discovers the Service's endpoints (the pods, for a PodMonitor)
    and sets the target labels namespace, service, pod, container and
    endpoint; here they are given statically, then the endpoint's own settings,
    relabelings and metric relabelings follow as the operator copies them. The
    interval is 1 s to keep the test short.
    """
    kind = monitor["kind"]
    endpoint = monitor["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"][0]
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}

    def rules(name: str) -> list[Doc]:
        return [
            {keys.get(k, k): (v.lower() if k == "action" else v) for k, v in rule.items()}
            for rule in endpoint.get(name, [])
        ]

    meta = monitor["metadata"]
    return {
        "job_name": f"{kind[0].lower()}{kind[1:]}/{meta['namespace']}/{meta['name']}/0",
        "honor_labels": endpoint.get("honorLabels", False),
        "metrics_path": endpoint["path"],
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "static_configs": [{"targets": [target], "labels": target_labels}],
        "relabel_configs": rules("relabelings"),
        "metric_relabel_configs": rules("metricRelabelings"),
    }


def node_page() -> bytes:
    """A node's /metrics series (as the coordinator or its agent renders them): GPU 0 is a training pod's."""
    report = node_pb2.NodeReport(sequence=1, timestamp_unix_seconds=1.0)
    report.gpu_inventory.backend = "nvml"
    report.gpus.add(
        index=0, uuid="GPU-0", utilization_ratio=0.9, pod="llama-0", namespace="training", container="pytorch"
    )
    report.gpus.add(index=1, uuid="GPU-1", utilization_ratio=0.1)
    exp = Exposition()
    write_node(exp, NODE_NAME, report)
    return exp.render()


@contextlib.contextmanager
def serving(page: bytes) -> Iterator[str]:
    """``page`` on /metrics of a loopback HTTP server; its host:port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def stored_after_scrapes(scrape_config: Doc, tmp_path: Path) -> list[dict[str, str]]:
    """The label sets of every series a real Prometheus stores from two scrapes with ``scrape_config``."""
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(json.dumps({"scrape_configs": [scrape_config]}))
    with (tmp_path / "prometheus.log").open("wb") as log:
        prometheus = subprocess.Popen(
            [
                require("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                "--web.listen-address=127.0.0.1:0",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def listening_port() -> int | None:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
            ports = [
                c.laddr.port
                for c in psutil.Process(prometheus.pid).net_connections("tcp")
                if c.status == "LISTEN"
            ]
            return ports[0] if ports else None

        port = wait_for(listening_port, 30, "Prometheus to listen")

        def query(expr: str) -> list[Doc]:
            params = urllib.parse.urlencode({"query": expr})
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?{params}", timeout=10) as r:
                return list(json.load(r)["data"]["result"])

        # Two scrapes: everything one scrape stores is then in the second's samples.
        wait_for(lambda: query("count_over_time(up[5m]) > 1") or None, 30, "two scrapes")
        return [s["metric"] for s in query('{__name__=~".+"}')]
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=10)


def by_gpu(series: list[dict[str, str]], name: str) -> dict[str, dict[str, str]]:
    return {s["gpu"]: s for s in series if s["__name__"] == name}


def test_prometheus_keeps_the_training_pods_labels_and_not_the_coordinators(tmp_path: Path) -> None:
    monitor = find("ServiceMonitor", "clusterwatch-coordinator")
    coordinator_pod = {
        "namespace": NAMESPACE,
        "service": "clusterwatch-coordinator",
        "pod": "clusterwatch-coordinator-5d8f7-x2x9k",
        "container": "coordinator",
        "endpoint": "metrics",
    }
    with serving(node_page()) as target:
        series = stored_after_scrapes(scrape_config_from(monitor, target, coordinator_pod), tmp_path)
    gpus = by_gpu(series, "clusterwatch_gpu_utilization_ratio")
    assigned, unassigned = gpus["0"], gpus["1"]
    assert (assigned["pod"], assigned["namespace"], assigned["container"]) == (
        "llama-0",
        "training",
        "pytorch",
    )
    # Not the coordinator's pod: an idle GPU is attributed to nobody.
    assert not {"pod", "namespace", "container"} & unassigned.keys(), unassigned
    assert assigned["node"] == unassigned["node"] == NODE_NAME
    assert assigned["service"] == "clusterwatch-coordinator"  # which scrape it came from stays visible


@pytest.mark.parametrize("hardware_series", ["coordinator", "agents"])
def test_prometheus_stores_from_the_agents_what_the_mode_wants(hardware_series: str, tmp_path: Path) -> None:
    """Default mode: the agents' own health only. Agents mode: the node's hardware series, with the
    training pod's labels (not the agent pod's), the job the alerts name, and no second node_up."""
    monitor = (
        find("PodMonitor", "clusterwatch-agent")
        if hardware_series == "coordinator"
        else with_component("PodMonitor", "clusterwatch-agent")
    )
    agent_pod = {
        "namespace": NAMESPACE,
        "pod": "clusterwatch-agent-q7x2m",
        "container": "agent",
        "endpoint": "metrics",
        "__meta_kubernetes_pod_node_name": NODE_NAME,
    }
    exp = Exposition()
    write_node_info(exp, NODE_NAME, NODE_NAME, "0.1.0", "nvml")
    exp.add(NODE_UP, f'node="{NODE_NAME}"', 1)
    exp.add(AGENT_CONNECTED, f'node="{NODE_NAME}"', 1)
    with serving(node_page() + exp.render()) as target:
        series = stored_after_scrapes(scrape_config_from(monitor, target, agent_pod), tmp_path)
    names = {s["__name__"] for s in series if s["__name__"].startswith("clusterwatch_")}
    (up,) = [s for s in series if s["__name__"] == "up"]
    assert (up["job"], up["instance"]) == ("clusterwatch-agent", NODE_NAME)  # ClusterwatchAgentDown's
    if hardware_series == "coordinator":
        assert names == {"clusterwatch_agent_connected"}  # the coordinator has the rest
        return
    assert "clusterwatch_node_up" not in names
    assert "clusterwatch_node_info" not in names
    gpus = by_gpu(series, "clusterwatch_gpu_utilization_ratio")
    assigned, unassigned = gpus["0"], gpus["1"]
    assert (assigned["pod"], assigned["namespace"], assigned["container"]) == (
        "llama-0",
        "training",
        "pytorch",
    )
    assert not {"pod", "namespace", "container"} & unassigned.keys(), unassigned
    assert assigned["node"] == NODE_NAME
    assert assigned["job"] == "clusterwatch-agent"


# --- several coordinators and their etcd ----------------------------------------


def group_coordinators() -> Doc:
    return find_group("StatefulSet", "clusterwatch-coordinator")


def pod_dns_name(statefulset: Doc, pod: str) -> str:
    """A StatefulSet pod's own DNS name, under the headless Service the StatefulSet names."""
    return f"{pod}.{statefulset['spec']['serviceName']}.{statefulset['metadata']['namespace']}.svc"


def flag_values(args: list[str], defined: dict[str, str]) -> dict[str, str]:
    """``--name=value`` arguments, with ``$(VAR)`` expanded as the kubelet does."""
    values = {}
    for arg in args:
        name, equals, value = arg.partition("=")
        assert arg.startswith("--"), arg
        assert equals, arg
        values[name] = expand(value, defined)
    return values


def test_the_coordinators_name_themselves_advertise_their_pod_and_share_the_etcd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinators = group_coordinators()
    assert coordinators["spec"]["replicas"] >= 2
    (container,) = coordinators["spec"]["template"]["spec"]["containers"]
    settings = container_settings(coordinators, config.CoordinatorSettings, tmp_path, monkeypatch)
    # Its name in the group is its pod's, stable across restarts; its address is the pod's own DNS name.
    assert settings.shard_id == POD_NAME
    host, port = config.split_host_port(settings.advertise)
    assert host == pod_dns_name(coordinators, POD_NAME)
    assert port == container_port(container, "grpc")
    pods_service = find_group("Service", coordinators["spec"]["serviceName"])
    assert pods_service["spec"]["clusterIP"] == "None"
    assert pods_service["spec"]["publishNotReadyAddresses"] is True
    pod_labels = coordinators["spec"]["template"]["metadata"]["labels"]
    assert pods_service["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"] for p in pods_service["spec"]["ports"]} == {p["name"] for p in container["ports"]}
    # Agents and clients first reach any coordinator through the base Service, which selects them all.
    service = find_group("Service", "clusterwatch-coordinator")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # Each coordinator keeps its own history on its own volume.
    (claim,) = coordinators["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(settings.state_dir)] == claim["metadata"]["name"]
    # The group's etcd: every member, by its own DNS name, on its client port.
    etcd = find_group("StatefulSet", "clusterwatch-etcd")
    (etcd_container,) = etcd["spec"]["template"]["spec"]["containers"]
    hosts, secure = parse_endpoints(settings.etcd)
    client_port = container_port(etcd_container, "client")
    members = [f"{etcd['metadata']['name']}-{i}" for i in range(etcd["spec"]["replicas"])]
    assert hosts == [f"{pod_dns_name(etcd, member)}:{client_port}" for member in members]
    assert not secure  # plain http, behind etcd-networkpolicy.yaml


def test_the_only_service_the_service_monitor_selects_is_the_one_each_coordinator_is_behind_once() -> None:
    for documents in (DOCUMENTS, GROUP_DOCUMENTS):
        monitor = find("ServiceMonitor", "clusterwatch-coordinator", documents)
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = [
            d["metadata"]["name"]
            for _, d in documents
            if d["kind"] == "Service" and selector.items() <= d["metadata"].get("labels", {}).items()
        ]
        assert selected == ["clusterwatch-coordinator"]


def test_a_planned_stop_drains_the_coordinator_before_it_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinators = group_coordinators()
    pod = coordinators["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[1:3] == ["coordinator", "drain"]
    # The hook sees the container's environment and config: it drains this pod's shard of this etcd.
    drained = container_settings(
        coordinators, config.CoordinatorSettings, tmp_path, monkeypatch, command=command
    )
    running = container_settings(coordinators, config.CoordinatorSettings, tmp_path, monkeypatch)
    assert (drained.shard_id, drained.etcd, drained.etcd_prefix) == (
        running.shard_id,
        running.etcd,
        running.etcd_prefix,
    )
    drain_timeout_s = (
        build_parser().parse_args([*command[1:3], "--drain-timeout-s", command[-1]]).drain_timeout_s
    )
    assert command[-2] == "--drain-timeout-s"
    # The kubelet kills the container after the grace period, drained or not: the drain must fit in it.
    assert drain_timeout_s < pod["terminationGracePeriodSeconds"]
    budget = find_group("PodDisruptionBudget", "clusterwatch-coordinator")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == coordinators["spec"]["selector"]["matchLabels"]


def etcd_help() -> str:
    etcd = require("etcd", package="etcd-server")
    result = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=30, check=False)
    return result.stdout + result.stderr


def test_the_etcd_members_find_each_other_and_only_coordinators_reach_them() -> None:
    etcd = find_group("StatefulSet", "clusterwatch-etcd")
    service = find_group("Service", etcd["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # peers meet before any is ready
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    env = container_env(container)
    flags = flag_values(container["args"], env)
    # Every flag is one etcd knows (Debian's etcd-server, the tests' etcd).
    known = etcd_help()
    assert not [flag for flag in flags if f"{flag} " not in known and f"{flag}=" not in known]
    peer_port, client_port = container_port(container, "peer"), container_port(container, "client")
    me = pod_dns_name(etcd, POD_NAME)
    assert flags["--name"] == POD_NAME
    assert flags["--initial-advertise-peer-urls"] == f"http://{me}:{peer_port}"
    assert flags["--advertise-client-urls"] == f"http://{me}:{client_port}"
    members = [f"{etcd['metadata']['name']}-{i}" for i in range(etcd["spec"]["replicas"])]
    assert flags["--initial-cluster"] == ",".join(
        f"{m}=http://{pod_dns_name(etcd, m)}:{peer_port}" for m in members
    )
    assert etcd["spec"]["replicas"] % 2 == 1  # a quorum survives the loss of a member
    data = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert data[flags["--data-dir"]] == etcd["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    # The NetworkPolicy lets coordinators reach the client port and members each other, no one else.
    policy = find_group("NetworkPolicy", "clusterwatch-etcd")
    assert policy["spec"]["podSelector"]["matchLabels"] == etcd["spec"]["selector"]["matchLabels"]
    allowed = {
        (peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"], port["port"])
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        for port in rule["ports"]
    }
    assert allowed == {("coordinator", "client"), ("etcd", "client"), ("etcd", "peer")}
    coordinator_labels = group_coordinators()["spec"]["template"]["metadata"]["labels"]
    assert coordinator_labels["app.kubernetes.io/component"] == "coordinator"


def test_the_coordinator_certificate_of_the_readme_is_valid_for_every_coordinator_pod(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Agents are redirected to a coordinator by its pod's DNS name: the certificate the README
    issues must pass gRPC's own host name check for every pod, and for nothing else."""
    readme = re.sub(r"\s*\\\n\s*", " ", (MANIFESTS / "README.md").read_text())  # one command a line
    (line,) = [line for line in readme.splitlines() if "clusterwatch certs issue coordinator" in line]
    words = shlex.split(line)
    sans = [words[i + 1] for i, word in enumerate(words) if word == "--san"]
    assert len(sans) == 2, line
    pki = tmp_path / "pki"
    certs.create_ca(pki)
    certs.issue(pki, "coordinator", role=Role.COORDINATOR, extra_sans=[*sans, "127.0.0.1"])
    certs.issue(pki, "reader", role=Role.USER)
    coordinator = cluster.coordinator(*tls_flags(pki))
    reader = tls_credentials(pki, "reader")

    def answers_as(name: str) -> grpc.StatusCode:
        options = [("grpc.ssl_target_name_override", name)]
        with grpc.secure_channel(coordinator.address, reader, options=options) as channel:
            try:
                cluster_pb2_grpc.ClusterServiceStub(channel).GetSnapshot(
                    cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=10
                )
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

    coordinators = group_coordinators()
    for i in range(coordinators["spec"]["replicas"] + 2):  # scaled up too
        assert answers_as(pod_dns_name(coordinators, f"clusterwatch-coordinator-{i}")) == grpc.StatusCode.OK
    service = find_group("Service", "clusterwatch-coordinator")
    assert answers_as(f"{service['metadata']['name']}.{NAMESPACE}.svc") == grpc.StatusCode.OK
    # The handshake fails for any other name (UNAVAILABLE), a wildcard covering one label only.
    for name in (
        f"clusterwatch-coordinator-0.elsewhere.{NAMESPACE}.svc",
        f"a.b.{pod_dns_name(coordinators, 'x')}",
    ):
        assert answers_as(name) == grpc.StatusCode.UNAVAILABLE
