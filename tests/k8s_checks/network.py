"""NetworkPolicies evaluated as a CNI would: which connections they let through, from pods of the namespace,
other namespaces or addresses; the loop's flows must pass, and nothing from outside but what is meant to."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from tests.k8s_checks.manifests import Manifests, Pod, Problem, Resource, selects, where


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
            problems.append(Problem("network-policies", where(pol), "podSelector selects no pod"))
        for rule in (pol["spec"].get("ingress") or []) + (pol["spec"].get("egress") or []):
            for peer in (rule.get("from") or []) + (rule.get("to") or []):
                if "podSelector" in peer and "namespaceSelector" not in peer and not any(
                    selects(peer["podSelector"], p.labels) for p in pods
                ):
                    problems.append(Problem("network-policies", where(pol), f"peer {peer} selects no pod"))
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
# "Anyone" as address blocks see them: a client on the internet, and a pod of another namespace (a pod's address
# is in the cluster's private range; a CNI matches ipBlocks against it too).
OUTSIDE_ADDRESSES = (Peer(address="203.0.113.7"), Peer(address="10.244.7.7"))

# What reads the model registry and must not write it (aliases, versions): it reaches MLflow only through the
# read-only proxy, never MLflow itself.
MLFLOW_READERS = ("serving", "signals-worker")

# (source app, destination app, destination port): what the loop needs inside the namespace.
NEEDED_FLOWS = [
    *[(app, "kafka", 9092) for app in ("collector", "serving", "ingest-worker", "signals-worker")],
    *[(app, "valkey", 6379) for app in ("serving", "signals-worker", "gate", "rollout", "trainer", "init")],
    *[(app, "mlflow", 5000) for app in ("mlflow-read", "gate", "rollout", "trainer", "init")],
    # The registry's readers go through its read-only proxy (engines/mlflow-read.yaml).
    *[(app, "mlflow-read", 5000) for app in MLFLOW_READERS],
    *[(app, "postgres", 5432) for app in ("mlflow", "mlflow-migrate", "gate", "rollout", "trainer")],
    # Lake maintenance asks the registry which table versions models trained on before it vacuums.
    *[(app, "mlflow", 5000) for app in ("lake-compaction", "lake-vacuum-full")],
]


# Where it runs (prod): the multi-node training cycle's pods reach each other (torchrun's rendezvous on the
# PyTorchJob's port, NCCL on any) and what the trainer reaches.
MULTINODE_FLOWS = [("trainer-multinode", dst, port) for dst, port in (
    ("trainer-multinode", 23456), ("valkey", 6379), ("mlflow", 5000), ("postgres", 5432))]

# The only pods anyone outside the namespace may reach (with a write key).
PUBLIC = ("collector",)
# Serving answers without a key: only its client namespaces (labelled) and the ingress controller reach it.
SERVING_CLIENT = Peer(namespace={"kubernetes.io/metadata.name": "product", "flywheel.io/serving-client": "true"})

# What reads or writes object storage: MLflow (its artifacts) and every process on the lake.
S3_CLIENTS = ("mlflow", "ingest-worker", "signals-worker", "gate", "rollout", "trainer", "lake-compaction",
              "lake-vacuum-full", "trainer-multinode")


# Containers that run a generation engine for the pod's own process (only it may call them).
ENGINES = ("vllm",)


def _app_pods(m: Manifests, app: str) -> list[Pod]:
    if app == "kafka":
        return [p for p in m.pods if p.labels.get("strimzi.io/broker-role") == "true"]
    return m.pods_by_app(app)


def metrics_ports(m: Manifests, pod: Pod) -> set[int]:
    """The pod's metrics ports: the ones it names `metrics`, and those a Service's port named `metrics` targets on
    it (Strimzi names Kafka's own `tcp-prometheus`). Each process serves /metrics there, never on its API's port."""
    ports = {port for name, port in pod.ports.items() if name == "metrics"}
    for svc in m.of("Service"):
        if svc["spec"].get("selector") and selects({"matchLabels": svc["spec"]["selector"]}, pod.labels):
            for p in svc["spec"]["ports"]:
                if p.get("name") == "metrics":
                    target = p.get("targetPort", p["port"])
                    ports.add(target if isinstance(target, int) else pod.ports.get(target, -1))
    return ports - {-1}


def check_network_flows(m: Manifests) -> list[Problem]:
    problems = []

    def need(src: Peer, dst: Peer, port: int, what: str, want: bool = True) -> None:
        if allowed(m, src, dst, port) != want:
            problems.append(Problem("network-flows", what, "refused" if want else "allowed, and must not be"))

    multinode = MULTINODE_FLOWS if _app_pods(m, "trainer-multinode") else []
    for src_app, dst_app, port in NEEDED_FLOWS + multinode:
        for src in _app_pods(m, src_app):
            for dst in _app_pods(m, dst_app):
                need(Peer(src.labels, pod=src), Peer(dst.labels, pod=dst), port, f"{src_app} -> {dst_app}:{port}")
        if not _app_pods(m, src_app) or not _app_pods(m, dst_app):
            problems.append(Problem("network-flows", f"{src_app} -> {dst_app}", "a side has no pod"))
    for app in MLFLOW_READERS:
        for src in _app_pods(m, app):
            for dst in _app_pods(m, "mlflow"):
                need(Peer(src.labels, pod=src), Peer(dst.labels, pod=dst), 5000,
                     f"{app} -> mlflow:5000 (past its read-only proxy)", False)
    minio = m.pods_by_app("minio")
    s3 = [Peer(p.labels, pod=p) for p in minio] or [OBJECT_STORAGE]
    for app in S3_CLIENTS:
        for src in _app_pods(m, app):
            for store in s3:
                port = 9000 if store.pod else 443
                need(Peer(src.labels, pod=src), store, port, f"{app} -> object storage:{port}")
    # From outside the namespace only the collector answers anyone, on every port any pod declares but its metrics
    # port (serving only its clients, the gate's dashboard only through the ingress controller, /metrics only
    # from Prometheus).
    for dst in m.pods:
        app = dst.labels.get("app", dst.owner)
        metrics = metrics_ports(m, dst)
        for port in sorted(set(dst.ports.values())):
            public = app in PUBLIC and port not in metrics
            need(OUTSIDE, Peer(dst.labels, pod=dst), port, f"outside -> {app}:{port}", public)
            for address in OUTSIDE_ADDRESSES:
                need(address, Peer(dst.labels, pod=dst), port, f"{address.address} -> {app}:{port}", public)
    for dst in m.pods_by_app("gate"):
        need(INGRESS_CONTROLLER, Peer(dst.labels, pod=dst), 8002, "ingress controller -> gate:8002")
    for dst in [p for p in m.pods if p.labels.get("acme.cert-manager.io/http01-solver") == "true"]:
        need(INGRESS_CONTROLLER, Peer(dst.labels, pod=dst), 8089, "ingress controller -> cert-manager's solver:8089")
    for dst in m.pods_by_app("serving"):
        need(SERVING_CLIENT, Peer(dst.labels, pod=dst), 8000, "a serving client's namespace -> serving:8000")
        need(INGRESS_CONTROLLER, Peer(dst.labels, pod=dst), 8000, "ingress controller -> serving:8000")
    # A generation engine beside serving (overlays/gpu's vLLM sidecar) answers serving's own container only: its
    # API loads and unloads adapters without a key, so no other pod of the namespace may open it.
    for dst in m.pods:
        engine = {p["containerPort"] for c in dst.containers if c["name"] in ENGINES for p in c.get("ports", [])}
        for port in sorted(engine):
            for src in m.pods:
                if src is not dst:
                    need(Peer(src.labels, pod=src), Peer(dst.labels, pod=dst), port,
                         f"{src.labels.get('app', src.owner)} -> {dst.owner}'s engine:{port}", False)
    scraped: set[tuple[str, int]] = set()
    for sm in m.of("ServiceMonitor"):
        svc = next((s for s in m.of("Service") if selects(sm["spec"]["selector"], s["metadata"].get("labels") or {})),
                   None)
        if svc is None:
            continue
        for pod in m.pods:
            if (pod.spec or pod.ports) and selects({"matchLabels": svc["spec"]["selector"]}, pod.labels):
                for ep in sm["spec"]["endpoints"]:
                    target = next((p.get("targetPort") for p in svc["spec"]["ports"]
                                   if p.get("name") == ep.get("port")), "")
                    port = target if isinstance(target, int) else pod.ports.get(target, 0)
                    need(PROMETHEUS, Peer(pod.labels, pod=pod), port, f"prometheus -> {pod.owner}:{port}")
                    scraped.add((pod.owner, port))
    # Monitoring reaches the metrics ports it scrapes and no other: never an API's port (the gate's approvals, the
    # trainer's manual run, serving's completions), though a ServiceMonitor scraped it. A port open to anyone (the
    # collector's) is the outside check's to judge.
    for dst in m.pods:
        metrics = metrics_ports(m, dst)
        reach = {p for o, p in scraped if o == dst.owner} & metrics
        for port in sorted(set(dst.ports.values()) - reach):
            if allowed(m, OUTSIDE, Peer(dst.labels, pod=dst), port):
                continue
            kind = "a metrics port it does not scrape" if port in metrics else "not a metrics port"
            need(PROMETHEUS, Peer(dst.labels, pod=dst), port, f"prometheus -> {dst.owner}:{port} ({kind})", False)
        for port in sorted({p for o, p in scraped if o == dst.owner} - metrics):
            problems.append(Problem("network-flows", f"prometheus -> {dst.owner}:{port}",
                                    "scraped, and not a metrics port (serve /metrics on a port named metrics)"))
    return problems
