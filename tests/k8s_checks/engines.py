"""The engines' resources: ServiceMonitors on real ports, Kafka resources that fit their cluster, workers
within the topic's partitions, Redis users that log in and only the gate's side writing the split."""

from __future__ import annotations

import fnmatch

from tests.k8s_checks.flywheel import METRICS_PORT_SETTING, command_of, environment, flywheel_args, setting_value
from tests.k8s_checks.manifests import Manifests, Problem, selects, where
from tests.k8s_checks.objects import containers


def check_service_monitors(m: Manifests) -> list[Problem]:
    """Each ServiceMonitor scrapes a Service's port named `metrics` (the only ports monitoring may reach), and a
    Flywheel process serves /metrics on the container port named `metrics` (its metrics-port setting)."""
    problems = []
    for sm in m.of("ServiceMonitor"):
        services = [s for s in m.of("Service") if selects(sm["spec"]["selector"], s["metadata"].get("labels") or {})]
        if not services:
            problems.append(Problem("service-monitors", where(sm), "selects no Service"))
        for ep in sm["spec"]["endpoints"]:
            if "port" in ep and not any(p.get("name") == ep["port"] for s in services for p in s["spec"]["ports"]):
                problems.append(Problem("service-monitors", where(sm), f"no selected Service has port {ep['port']!r}"))
            if ep.get("port") != "metrics":
                scraped = ep.get("port") or ep.get("targetPort")
                problems.append(Problem("service-monitors", where(sm), f"scrapes {scraped!r}, not a metrics port"))
    for owner, c in containers(m):
        declared = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == "metrics"]
        args = flywheel_args(c)
        if not declared or args is None:
            continue
        setting = METRICS_PORT_SETTING.get(command_of(args))
        served = setting_value(environment(m, c), setting) if setting else "no port"
        if served != str(declared[0]):
            problems.append(Problem("service-monitors", where(owner), f"{c['name']}: `flywheel {' '.join(args)}` "
                                    f"serves /metrics on {served} ({setting}), not its metrics port {declared[0]}"))
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
            problems.append(Problem("kafka", where(obj), f"names Kafka cluster {cluster!r}, which does not exist"))
            continue
        if obj["kind"] == "KafkaTopic":
            replicas = obj["spec"].get("replicas", 1)
            if replicas > brokers.get(cluster or "", 0):
                problems.append(Problem("kafka", where(obj), f"{replicas} replicas on {brokers.get(cluster or '', 0)} "
                                        "brokers"))
            isr = int((obj["spec"].get("config") or {}).get("min.insync.replicas", 1))
            if isr > replicas:
                problems.append(Problem("kafka", where(obj), f"min.insync.replicas {isr} > replicas {replicas}"))
        if obj["kind"] == "KafkaUser":
            for acl in obj["spec"].get("authorization", {}).get("acls", []):
                res = acl["resource"]
                if res["type"] == "topic" and res.get("patternType", "literal") == "literal" \
                        and res["name"] not in topics:
                    problems.append(Problem("kafka", where(obj), f"ACL names topic {res['name']!r}, not declared"))
    for kafka in m.of("Kafka"):
        name = kafka["metadata"]["name"]
        if not brokers.get(name) or not controllers.get(name):
            problems.append(Problem("kafka", where(kafka), "needs node pools with broker and controller roles"))
        for listener in kafka["spec"]["kafka"].get("listeners", []):
            if listener.get("tls") is not True:
                problems.append(Problem("kafka", where(kafka), f"listener {listener.get('name')!r} is not TLS: "
                                        "events and passwords would cross the network in clear"))
    problems += _kafka_clients_verify_the_cluster_ca(m)
    return problems


def _kafka_clients_verify_the_cluster_ca(m: Manifests) -> list[Problem]:
    """Every Flywheel Kafka client speaks SASL_SSL and trusts the cluster's CA: FLYWHEEL_KAFKA_SSL_CAFILE is the
    ca.crt that a volume of Strimzi's `<cluster>-cluster-ca-cert` Secret puts there."""
    problems = []
    clusters = {k["metadata"]["name"] for k in m.of("Kafka")}
    for owner, tpl in m.workloads():
        volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
        for c in tpl["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            protocol = env.get("FLYWHEEL_KAFKA_SECURITY_PROTOCOL")
            if protocol is None:
                continue
            if protocol != "SASL_SSL":
                problems.append(Problem("kafka", where(owner), f"{c['name']}: Kafka protocol {protocol}, not SASL_SSL"))
                continue
            cafile = env.get("FLYWHEEL_KAFKA_SSL_CAFILE") or ""
            source = None
            for mount in c.get("volumeMounts", []):
                root = mount["mountPath"].rstrip("/") + "/"
                secret = volumes.get(mount["name"], {}).get("secret")
                if cafile.startswith(root) and secret is not None:
                    items = {i["path"]: i["key"] for i in secret.get("items", [])}
                    rel = cafile[len(root):]
                    source = (secret["secretName"], items.get(rel, rel) if items else rel)
            if source is None or source[1] != "ca.crt" or source[0] not in {f"{k}-cluster-ca-cert" for k in clusters}:
                problems.append(Problem("kafka", where(owner), f"{c['name']}: FLYWHEEL_KAFKA_SSL_CAFILE {cafile!r} is "
                                        f"not the cluster CA's ca.crt (mounted from {source})"))
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
            problems.append(Problem("partitions", where(dep),
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
                problems.append(Problem("redis-users", where(owner), f"user {parsed.username!r} cannot log in"))
            elif _may_write(rules, SPLIT_KEY) != (app in SPLIT_WRITERS):
                problems.append(Problem("redis-users", where(owner),
                                        f"{app} {'may' if app not in SPLIT_WRITERS else 'may not'} write the split"))
    return problems
