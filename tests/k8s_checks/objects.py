"""What an API server refuses or a cluster would trip on, object by object: names, ports, enums, selectors
that select, Services that reach a port, references that resolve, fixed image tags, resources."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from tests.k8s_checks.manifests import Manifests, Problem, Resource, selects, where

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_LABEL_KINDS = {"Service", "Namespace"}  # their names become DNS labels


def check_names(m: Manifests) -> list[Problem]:
    problems = []

    def bad(obj: Resource, what: str) -> None:
        problems.append(Problem("names", where(obj), what))

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
                    problems.append(Problem("ports", where(owner), f"containerPort {p.get('containerPort')}"))
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                action = c.get(probe, {}).get("httpGet") or c.get(probe, {}).get("tcpSocket") or {}
                if not _in_range(action.get("port")):
                    problems.append(Problem("ports", where(owner), f"{probe} port {action.get('port')}"))
    for svc in m.of("Service"):
        for p in svc["spec"].get("ports", []):
            for key in ("port", "targetPort", "nodePort"):
                if key in p and not _in_range(p[key]):
                    problems.append(Problem("ports", where(svc), f"{key} {p[key]} out of 1-65535"))
    for pol in m.of("NetworkPolicy"):
        for direction in ("ingress", "egress"):
            for rule in pol["spec"].get(direction) or []:
                for p in rule.get("ports") or []:
                    if not _in_range(p.get("port")):
                        problems.append(Problem("ports", where(pol), f"{direction} port {p.get('port')}"))
    return problems


_ENUMS: list[tuple[str, Callable[[Manifests], Iterator[tuple[Resource, str, Any]]], set[str]]] = []


def _enum(name: str, allowed: set[str]) -> Callable[[Callable[[Manifests], Iterator[tuple[Resource, Any]]]], None]:
    def register(values: Callable[[Manifests], Iterator[tuple[Resource, Any]]]) -> None:
        _ENUMS.append((name, lambda m: ((o, name, v) for o, v in values(m)), allowed))

    return register


def containers(m: Manifests) -> Iterator[tuple[Resource, Resource]]:
    """(workload, container) for every container of every pod template, init containers included."""
    for owner, tpl in m.workloads():
        for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]:
            yield owner, c


@_enum("protocol", {"TCP", "UDP", "SCTP"})
def _protocols(m: Manifests) -> Iterator[tuple[Resource, Any]]:
    for owner, c in containers(m):
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
    for owner, c in containers(m):
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
                problems.append(Problem("enums", where(obj), f"{what} {value!r} is not one of {sorted(allowed)}"))
    for owner, tpl in m.workloads():
        policy = tpl["spec"].get("restartPolicy", "Always")
        if owner["kind"] in ("Deployment", "StatefulSet", "DaemonSet") and policy != "Always":
            problems.append(Problem("enums", where(owner), f"restartPolicy {policy!r}: only Always is allowed"))
        if owner["kind"] in ("Job", "CronJob") and policy not in ("OnFailure", "Never"):
            problems.append(Problem("enums", where(owner), f"restartPolicy {policy!r}: OnFailure or Never"))
    return problems


def check_selectors(m: Manifests) -> list[Problem]:
    problems = []
    for d in m.of("Deployment") + m.of("StatefulSet") + m.of("DaemonSet"):
        labels = d["spec"]["template"].get("metadata", {}).get("labels") or {}
        selector = d["spec"].get("selector")
        if not selector or not selector.get("matchLabels") and not selector.get("matchExpressions"):
            problems.append(Problem("selectors", where(d), "no selector"))
        elif not selects(selector, labels):
            problems.append(Problem("selectors", where(d), f"selector {selector} does not match template {labels}"))
    for s in m.of("StatefulSet"):
        if m.get("Service", s["spec"].get("serviceName", "")) is None:
            problems.append(Problem("selectors", where(s), f"serviceName {s['spec'].get('serviceName')!r} missing"))
    for pdb in m.of("PodDisruptionBudget"):
        if not any(selects(pdb["spec"].get("selector"), p.labels) for p in m.pods):
            problems.append(Problem("selectors", where(pdb), "selects no pod"))
    for hpa in m.of("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if m.get(ref["kind"], ref["name"]) is None:
            problems.append(Problem("selectors", where(hpa), f"scales {ref['kind']}/{ref['name']}, which is missing"))
    return problems


def check_services(m: Manifests) -> list[Problem]:
    problems = []
    for svc in m.of("Service"):
        selector = svc["spec"].get("selector")
        if not selector:
            continue
        # Our templates, and the pods an operator makes (known by their labels and ports).
        pods = [p for p in m.pods if (p.spec or p.ports) and selects({"matchLabels": selector}, p.labels)]
        if not pods:
            problems.append(Problem("services", where(svc), f"selector {selector} selects no workload"))
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            if not any(p.has_port(target) for p in pods):
                problems.append(Problem("services", where(svc), f"no selected container has port {target!r}"))
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
                problems.append(Problem("references", where(owner), f"claim {name!r} does not exist"))
            continue
        data = m.data(kind, name)
        if data is None:
            problems.append(Problem("references", where(owner), f"{kind} {name!r} does not exist"))
        elif key is not None and key not in data:
            problems.append(Problem("references", where(owner), f"{kind} {name!r} has no key {key!r}"))
    for ing in m.of("Ingress"):
        for rule in ing["spec"].get("rules", []):
            for path in rule.get("http", {}).get("paths", []):
                svc_ref = path["backend"]["service"]
                svc = m.get("Service", svc_ref["name"])
                port = svc_ref["port"].get("name", svc_ref["port"].get("number"))
                if svc is None:
                    problems.append(Problem("references", where(ing), f"Service {svc_ref['name']!r} missing"))
                elif not any(port in (p.get("name"), p["port"]) for p in svc["spec"]["ports"]):
                    problems.append(Problem("references", where(ing), f"Service {svc_ref['name']} has no port {port}"))
    return problems


# Where a namespace asks for digests (prod), every image must carry one: `@sha256:` and 64 hex digits.
PINNED_LABEL = "flywheel.io/images-pinned"
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
"""What the repository's prod overlays carry until an operator pins real images: no registry holds it, so a pod
on it fails to pull instead of running an unpinned image (k8s/README.md, "Images")."""


def pinned(m: Manifests) -> bool:
    """Whether the namespace asks for every image to be pinned by digest."""
    return any((ns["metadata"].get("labels") or {}).get(PINNED_LABEL) == "true" for ns in m.of("Namespace"))


def check_images(m: Manifests) -> list[Problem]:
    """Every image has a fixed tag (never latest) or a digest; where the namespace asks (prod), a digest."""
    problems = []
    digests = pinned(m)
    for owner, c in containers(m):
        image = c.get("image", "")
        name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
        if digests and not _DIGEST.search(image):
            problems.append(Problem("images", where(owner), f"container {c['name']}: image {image!r} is not pinned "
                                    f"by digest (the namespace's {PINNED_LABEL} asks for it)"))
            continue
        if "@sha256:" in image:
            continue
        if not tag or tag == "latest":
            problems.append(Problem("images", where(owner),
                                    f"container {c['name']}: image {image!r} has no fixed tag"))
    return problems


def check_resources(m: Manifests) -> list[Problem]:
    problems = []
    for owner, c in containers(m):
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            for what in ("cpu", "memory"):
                if what not in (res.get(part) or {}):
                    problems.append(Problem("resources", where(owner), f"container {c['name']}: no {part}.{what}"))
    for obj in m.of("KafkaNodePool"):
        res = obj["spec"].get("resources") or {}
        if not res.get("requests") or not res.get("limits"):
            problems.append(Problem("resources", where(obj), "no requests and limits"))
    return problems
