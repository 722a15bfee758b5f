"""The built manifests and what the checks ask of them: objects by kind, pod templates (and the pods
Strimzi will make), ConfigMap and Secret data, label selectors."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
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


def where(obj: Resource) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


class Manifests:
    def __init__(self, docs: list[Resource]) -> None:
        self.docs = [d for d in docs if d]

    def of(self, kind: str) -> list[Resource]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str) -> Resource | None:
        return next((d for d in self.of(kind) if d["metadata"]["name"] == name), None)

    def data(self, kind: str, name: str) -> dict[str, str] | None:
        """A ConfigMap's or Secret's keys and (decoded) values; an operator's Secret has its keys, values unknown."""
        obj = self.get(kind, name)
        if obj is None:
            return dict.fromkeys(self._operator_secrets().get(name, []), "") or None if kind == "Secret" else None
        out = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "Secret":
            out = {k: base64.b64decode(v).decode() for k, v in out.items()}
            out.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
        out.update({k: "" for k in (obj.get("binaryData") or {})})
        return out

    def _operator_secrets(self) -> dict[str, list[str]]:
        """Secrets an operator makes from these objects, by name, with their keys: Strimzi's cluster CA
        certificate for each Kafka (what its clients trust)."""
        return {f"{k['metadata']['name']}-cluster-ca-cert": ["ca.crt", "ca.p12", "ca.password"]
                for k in self.of("Kafka")}

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
            # Sidecars (init containers that keep running) serve beside the containers.
            serving = spec.get("containers", []) + [c for c in spec.get("initContainers", [])
                                                    if c.get("restartPolicy") == "Always"]
            ports = {p.get("name", str(p["containerPort"])): p["containerPort"] for c in serving
                     for p in c.get("ports", [])}
            pods.append(Pod(where(owner), dict(tpl.get("metadata", {}).get("labels") or {}), spec, ports))
        pods += self._strimzi_pods()
        pods += self._acme_solver_pods()
        return pods

    def _acme_solver_pods(self) -> list[Pod]:
        """The HTTP-01 solver pod cert-manager starts beside an Ingress whose certificate it issues."""
        issued = [i for i in self.of("Ingress")
                  if "cert-manager.io/cluster-issuer" in (i["metadata"].get("annotations") or {})]
        return [Pod(f"{where(i)} (cert-manager's solver)", {"acme.cert-manager.io/http01-solver": "true"}, {},
                    {"http": 8089}) for i in issued]

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
            if kafka and kafka["spec"]["kafka"].get("metricsConfig"):
                ports["tcp-prometheus"] = 9404  # every node's metrics, when the Kafka asks for them
            if "broker" in pool["spec"].get("roles", []):
                labels["strimzi.io/broker-role"] = "true"
                ports.update({f"{lst['name']}-{lst['port']}": lst["port"] for lst in listeners})
            out.append(Pod(where(pool), labels, {}, ports))
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


_PLACEHOLDER = re.compile(r"REPLACE[-A-Za-z0-9]*")


def filled(placeholder: str) -> str:
    """A strong value for a secrets.example placeholder, the same wherever it appears (a password in users.acl
    and in a Redis URL, in postgres.env and in a database URL), as an operator fills them in."""
    return "v" + hashlib.sha256(placeholder.encode()).hexdigest()[:39]


@contextlib.contextmanager
def prod_with_example_secrets(tmp: Path) -> Iterator[Path]:
    """overlays/prod reads secrets from files kept out of git: build a copy with secrets.example in their place,
    every REPLACE placeholder filled in (production settings refuse a placeholder)."""
    copy = tmp / "k8s"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets"))
    prod = copy / "overlays" / "prod"
    shutil.copytree(prod / "secrets.example", prod / "secrets")
    for path in (prod / "secrets").iterdir():
        path.write_text(_PLACEHOLDER.sub(lambda m: filled(m.group(0)), path.read_text()))
    yield prod




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
