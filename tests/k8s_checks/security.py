"""What a platform engineer reads a deployment for before running it, checked on every rendered pod and object:

- pod security: every pod meets the pod-security "restricted" profile that the namespace enforces (what Pod
  Security Admission would refuse), and mounts no service-account token it does not use;
- secrets: no secret value, and nothing shaped or named like one, outside a Secret object; each Flywheel
  process gets only the secret keys its command reads, one key at a time;
- ownership: nothing an autoscaler or an operator owns is set in the applied manifests, so a server-side
  apply of a new image neither conflicts nor resets it;
- drain: every server stops taking traffic before SIGTERM, within a grace period that covers it;
- state services: Valkey refuses writes at its memory bound rather than evicting state or being OOM-killed,
  with room for an AOF rewrite; Kafka exports metrics; monitors carry the label Prometheus selects by;
- values: the settings no schema types (CronJob schedules, topic configs) hold allowed values, and no
  PodDisruptionBudget keeps as many pods as its workload runs (a node drain would wait forever).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from tests.k8s_checks.flywheel import flywheel_args
from tests.k8s_checks.manifests import Manifests, Problem, Resource, where
from tests.k8s_checks.objects import containers

# --- pod security -----------------------------------------------------------------------------------------

# https://kubernetes.io/docs/concepts/security/pod-security-standards/ ("restricted", latest).
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret", "image"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}
_SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _pod_problems(spec: Resource) -> Iterator[str]:
    pod = spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            yield f"{host}: true"
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            yield f"volume {vol['name']}: {sorted(kinds - _RESTRICTED_VOLUMES)} is not allowed"
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in _SAFE_SYSCTLS:
            yield f"sysctl {sysctl.get('name')} is not a safe one"
    if pod.get("runAsUser") == 0:
        yield "pod runAsUser 0"
    if (pod.get("seLinuxOptions") or {}).get("type") not in _SELINUX_TYPES:
        yield "pod seLinuxOptions.type is not allowed"
    if spec.get("automountServiceAccountToken") is not False:
        yield "automountServiceAccountToken is not false (no pod here talks to the API server)"
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            yield f"{name}: privileged"
        if sc.get("allowPrivilegeEscalation") is not False:
            yield f"{name}: allowPrivilegeEscalation is not false"
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            yield f"{name}: capabilities do not drop ALL"
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            yield f"{name}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}"
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            yield f"{name}: runAsNonRoot is not true"
        if sc.get("runAsUser", pod.get("runAsUser")) == 0:
            yield f"{name}: runAsUser 0"
        seccomp = (sc.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            yield f"{name}: seccompProfile is {seccomp or 'unset'}, not RuntimeDefault or Localhost"
        if sc.get("procMount", "Default") != "Default":
            yield f"{name}: procMount {sc['procMount']}"
        if (sc.get("seLinuxOptions") or {}).get("type") not in _SELINUX_TYPES:
            yield f"{name}: seLinuxOptions.type is not allowed"
        for p in c.get("ports", []):
            if p.get("hostPort"):
                yield f"{name}: hostPort {p['hostPort']}"


def check_pod_security(m: Manifests) -> list[Problem]:
    """Every pod template meets pod-security "restricted", and the namespace enforces it."""
    problems = [Problem("pod-security", where(owner), what)
                for owner, tpl in m.workloads() for what in _pod_problems(tpl.get("spec") or {})]
    for ns in m.of("Namespace"):
        if (ns["metadata"].get("labels") or {}).get("pod-security.kubernetes.io/enforce") != "restricted":
            problems.append(Problem("pod-security", where(ns), "does not enforce pod-security restricted"))
    return problems


# --- secrets ----------------------------------------------------------------------------------------------

# A name that says "secret": environment variables, ConfigMap keys, annotations.
_SECRET_NAME = re.compile(r"pass(word|wd)?\b|passw|secret|token|credential|private|api[-_]?key|_keys?$|^keys?$",
                          re.IGNORECASE)
# Names that match but hold no secret: a header's name, a key's id.
_NOT_SECRET_NAMES = {"FLYWHEEL_OTLP_WRITE_KEY_HEADER"}
# Values shaped like a secret whatever their name.
_SECRET_SHAPES = [
    (re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:[^@\s/]+@"), "a URL with a password"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "an AWS access key id"),
    (re.compile(r"(^|\s)>[^\s]{8,}"), "a Redis ACL password"),
]
_MIN_LEAK = 10  # shorter secret values (a user name) may appear elsewhere by chance


def _secret_values(m: Manifests) -> dict[str, str]:
    """Every secret string the Secrets hold -> where: whole values and the passwords inside URLs and ACL files."""
    out = {}
    for secret in m.of("Secret"):
        for key, value in (m.data("Secret", secret["metadata"]["name"]) or {}).items():
            at = f"Secret {secret['metadata']['name']} key {key}"
            for part in [value, *re.findall(r">(\S+)", value), *_url_passwords(value)]:
                if len(part) >= _MIN_LEAK:
                    out[part] = at
    return out


def _url_passwords(text: str) -> list[str]:
    found = []
    for url in re.findall(r"[a-z][a-z0-9+.-]*://\S+", text):
        try:
            password = urlsplit(url).password
        except ValueError:
            password = None
        if password:
            found.append(password)
    return found


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, string) for every string in a document, keys included as paths."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def _named_literals(obj: Resource) -> Iterator[tuple[str, str]]:
    """(name, literal value) pairs a reader takes for configuration: ConfigMap data, env values, annotations."""
    if obj.get("kind") == "ConfigMap":
        yield from ((k, str(v)) for k, v in (obj.get("data") or {}).items())
    yield from ((k, str(v)) for k, v in (obj.get("metadata", {}).get("annotations") or {}).items())
    for _, tpl in Manifests([obj]).workloads():
        for c in (tpl.get("spec") or {}).get("initContainers", []) + (tpl.get("spec") or {}).get("containers", []):
            yield from ((e["name"], str(e["value"])) for e in c.get("env", []) if "value" in e)


def check_secrets(m: Manifests) -> list[Problem]:
    """No Secret's value, and nothing named or shaped like a secret, anywhere but in a Secret."""
    problems = []
    values = _secret_values(m)
    for obj in m.docs:
        if obj.get("kind") == "Secret":
            continue
        for path, text in _strings(obj):
            leaked = next((at for value, at in values.items() if value in text), None)
            if leaked:
                problems.append(Problem("secrets", where(obj), f"{path} holds the value of {leaked}"))
                continue
            shape = next((what for pattern, what in _SECRET_SHAPES if pattern.search(text)), None)
            if shape:
                problems.append(Problem("secrets", where(obj), f"{path} holds {shape}"))
        for name, literal in _named_literals(obj):
            if literal and _SECRET_NAME.search(name) and name not in _NOT_SECRET_NAMES:
                problems.append(Problem("secrets", where(obj), f"{name} is named like a secret and is not in a Secret"))
    return problems


# The secrets each Flywheel command reads from its settings (flywheel/settings.py's SecretStr fields), and
# where: a process is given these keys and no other (least privilege), each as one secretKeyRef.
#   write keys        the collector's doors (ingest/collector/app.py);
#   serving API keys  what callers of serving's /v1 endpoints present (serving/app.py);
#   serving key       serving signs generations (serving/__init__.py), the trainer verifies them
#                     (trainer/data.py), the gate's offline gates verify logged ones (deploy_gate/offline/logged.py),
#                     which the rollout controller's plans run through;
#   approval token,   the bootstrap admin and the issued tokens of the HTTP APIs that authenticate: the gate,
#   token store       the rollout controller's API and the gate's audit log, the trainer's API (flywheel/identity.py).
# The collector also scrubs the serving key and the approval token from dead letters when it holds them; it is
# not given them, so it holds none to leak.
SECRET_SETTINGS = {"FLYWHEEL_WRITE_KEYS", "FLYWHEEL_SERVING_KEY", "FLYWHEEL_SERVING_API_KEYS",
                   "FLYWHEEL_APPROVAL_TOKEN", "FLYWHEEL_TOKEN_STORE_URL"}  # fmt: skip
_API = {"FLYWHEEL_APPROVAL_TOKEN", "FLYWHEEL_TOKEN_STORE_URL"}
SECRETS_READ: dict[tuple[str, ...], set[str]] = {
    ("ingest", "collector"): {"FLYWHEEL_WRITE_KEYS"},
    ("serve",): {"FLYWHEEL_SERVING_KEY", "FLYWHEEL_SERVING_API_KEYS"},
    ("ingest", "worker"): set(),
    ("signals", "worker"): set(),
    ("gate", "serve"): {"FLYWHEEL_SERVING_KEY", *_API},
    ("gate", "rollout"): {"FLYWHEEL_SERVING_KEY", *_API},
    ("trainer", "schedule"): {"FLYWHEEL_SERVING_KEY", *_API},
    ("trainer", "run-once"): {"FLYWHEEL_SERVING_KEY"},
    ("lake",): set(),
    ("init",): set(),
}
# Credentials of the engines, one per process already (its Kafka user, its Redis user, the lake's keys).
_ENGINE_SECRETS = {"FLYWHEEL_KAFKA_SASL_PASSWORD", "REDIS_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def secrets_read(args: list[str]) -> set[str] | None:
    """The secret settings a `flywheel ...` command line reads (None: a command not in the table)."""
    for n in (2, 1):
        if tuple(args[:n]) in SECRETS_READ:
            return SECRETS_READ[tuple(args[:n])]
    return None


def check_secret_keys(m: Manifests) -> list[Problem]:
    """Each Flywheel container gets the secret keys its command reads, one by one, and no other."""
    problems = []
    for owner, c in containers(m):
        args = flywheel_args(c)
        if args is None:
            continue
        name = f"{where(owner)} {c['name']}"
        for src in c.get("envFrom", []):
            if "secretRef" in src:
                problems.append(Problem("secret-keys", name, f"gets all of Secret {src['secretRef']['name']} "
                                        "(envFrom): give it the keys it reads, each as a secretKeyRef"))
        given = {e["name"] for e in c.get("env", []) if "secretKeyRef" in (e.get("valueFrom") or {})}
        wanted = secrets_read(args)
        if wanted is None:
            problems.append(Problem("secret-keys", name, f"flywheel {' '.join(args[:2])}: which secrets it reads "
                                    "is not known (tests/k8s_checks/security.py, SECRETS_READ)"))
            continue
        extra = (given & SECRET_SETTINGS) - wanted | (given - SECRET_SETTINGS - _ENGINE_SECRETS)
        if extra:
            problems.append(Problem("secret-keys", name, f"gets {sorted(extra)}, which it does not read"))
        if wanted - given:
            problems.append(Problem("secret-keys", name, f"lacks {sorted(wanted - given)}, which it reads"))
    return problems


# --- ownership --------------------------------------------------------------------------------------------


def check_ownership(m: Manifests) -> list[Problem]:
    """Nothing an HPA or an operator owns is set: a server-side apply would fight it on every rollout."""
    problems = []
    for hpa in m.of("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = m.get(ref["kind"], ref["name"])
        if target is not None and "replicas" in target["spec"]:
            problems.append(Problem("ownership", where(target), f"sets replicas, which {where(hpa)} owns"))
    for job in m.of("PyTorchJob"):
        if "suspend" in (job["spec"].get("runPolicy") or {}):
            problems.append(Problem("ownership", where(job), "sets runPolicy.suspend: each apply re-suspends a "
                                    "started run; create a job per run instead"))
    for job in m.of("Job"):
        if "ttlSecondsAfterFinished" in job["spec"] and job["spec"]["ttlSecondsAfterFinished"] > 0:
            problems.append(Problem("ownership", where(job), "a finished Job kept by a TTL refuses the next apply's "
                                    "changed template (immutable) until the TTL deletes it"))
    return problems


# --- drain ------------------------------------------------------------------------------------------------

_DRAIN_S = 10  # what a server needs after its endpoints are gone to finish the requests it has


def check_drain(m: Manifests) -> list[Problem]:
    """Every server (a Deployment's container with a port) waits in preStop for its endpoints to be removed,
    then has the grace period to finish its requests."""
    problems = []
    for dep in m.of("Deployment"):
        spec = dep["spec"]["template"]["spec"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        for c in spec["containers"]:
            if not c.get("ports") or flywheel_args(c) is None:
                continue
            pre = (c.get("lifecycle") or {}).get("preStop")
            if pre is None:
                problems.append(Problem("drain", where(dep), f"{c['name']}: no preStop: SIGTERM races the endpoint's "
                                        "removal"))
                continue
            wait = (pre.get("sleep") or {}).get("seconds", 0)
            if grace < wait + _DRAIN_S:
                problems.append(Problem("drain", where(dep), f"{c['name']}: grace {grace}s < preStop {wait}s + "
                                        f"{_DRAIN_S}s to drain"))
    return problems


# --- state services ---------------------------------------------------------------------------------------

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "kb": 1024, "mb": 1024**2, "gb": 1024**3,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def quantity(text: str) -> int:
    """Bytes in a Kubernetes quantity or a Redis memory size.

    >>> quantity("4Gi"), quantity("2gb"), quantity("512Mi")
    (4294967296, 2147483648, 536870912)
    """
    number, unit = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text)).groups()  # type: ignore[union-attr]
    return int(float(number) * _UNITS[unit.lower()])


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def check_state_services(m: Manifests) -> list[Problem]:
    problems = []
    for sts in m.of("StatefulSet"):
        for c in sts["spec"]["template"]["spec"]["containers"]:
            args = [str(a) for a in c.get("args") or []]
            if "--appendonly" not in args:
                continue
            maxmemory, policy = _flag(args, "--maxmemory"), _flag(args, "--maxmemory-policy")
            if maxmemory is None or policy != "noeviction":
                problems.append(Problem("state-services", where(sts), "Valkey needs --maxmemory and "
                                        "--maxmemory-policy noeviction (state must be refused, never evicted)"))
                continue
            limit = quantity(c["resources"]["limits"]["memory"])
            # An AOF rewrite forks: copy-on-write pages can double the resident data under heavy writes.
            if quantity(maxmemory) * 2 > limit:
                problems.append(Problem("state-services", where(sts), f"maxmemory {maxmemory} leaves no room for "
                                        f"an AOF rewrite in the {c['resources']['limits']['memory']} limit"))
            claims = {t["metadata"]["name"]: t["spec"]["resources"]["requests"]["storage"]
                      for t in sts["spec"].get("volumeClaimTemplates", [])}
            size = claims.get("data")
            # The AOF grows to twice its rewritten size (auto-aof-rewrite-percentage 100), and a rewrite writes
            # a new one beside it.
            if size is None or quantity(size) < 3 * quantity(maxmemory):
                problems.append(Problem("state-services", where(sts), f"AOF volume {size} < 3 x maxmemory"))
    for kafka in m.of("Kafka"):
        if not kafka["spec"]["kafka"].get("metricsConfig"):
            problems.append(Problem("state-services", where(kafka), "exports no metrics (metricsConfig)"))
    for obj in m.of("ServiceMonitor") + m.of("PrometheusRule"):
        if "release" not in (obj["metadata"].get("labels") or {}):
            problems.append(Problem("state-services", where(obj), "no release label for Prometheus to select it by"))
    migrates = [j for j in m.of("Job") if j["spec"]["template"]["metadata"].get("labels", {}).get("app")
                == "mlflow-migrate"]
    for dep in m.of("Deployment"):
        if dep["spec"]["template"]["metadata"].get("labels", {}).get("app") == "mlflow" and not migrates:
            problems.append(Problem("state-services", where(dep), "MLflow, and no one Job that migrates its "
                                    "database first: its replicas would all migrate an empty one at once"))
    return problems


# --- values no schema types ------------------------------------------------------------------------------

_CRON_FIELDS = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]
_CRON_NAMES = {3: ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"],
               4: ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]}


def cron_ok(schedule: str) -> bool:
    """Whether a CronJob schedule is one the controller parses (five fields, or an @macro).

    >>> cron_ok("17 * * * *"), cron_ok("47 3 * * *"), cron_ok("*/15 9-17 * * mon-fri"), cron_ok("@daily")
    (True, True, True, True)
    >>> cron_ok("60 * * * *"), cron_ok("17 * * *"), cron_ok("every hour")
    (False, False, False)
    """
    if schedule in ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"):
        return True
    fields = schedule.split()
    if len(fields) != 5:
        return False
    for i, (field, (low, high)) in enumerate(zip(fields, _CRON_FIELDS, strict=True)):
        for part in field.split(","):
            base, _, step = part.partition("/")
            if step and not step.isdigit():
                return False
            if base in ("*", "?"):
                continue
            for bound in base.split("-"):
                names = _CRON_NAMES.get(i, [])
                if bound.lower() in names:
                    continue
                if not bound.isdigit() or not low <= int(bound) <= high:
                    return False
    return True


# Topic configs Strimzi passes to Kafka untyped: a wrong value fails only when the Topic Operator applies it.
_TOPIC_CONFIG: dict[str, Any] = {
    "cleanup.policy": {"delete", "compact", "compact,delete", "delete,compact"},
    "compression.type": {"uncompressed", "zstd", "lz4", "snappy", "gzip", "producer"},
    "message.timestamp.type": {"CreateTime", "LogAppendTime"},
    "retention.ms": int, "retention.bytes": int, "segment.bytes": int, "segment.ms": int,
    "max.message.bytes": int, "min.insync.replicas": int, "delete.retention.ms": int,
}


def _fewest_replicas(m: Manifests, selector: Resource) -> int | None:
    """The fewest replicas the workloads a PodDisruptionBudget selects run (an HPA's minimum where one scales)."""
    from tests.k8s_checks.manifests import selects

    total = None
    for d in m.of("Deployment") + m.of("StatefulSet"):
        if selects(selector, d["spec"]["template"]["metadata"].get("labels") or {}):
            hpa = next((h for h in m.of("HorizontalPodAutoscaler")
                        if h["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]), None)
            n = hpa["spec"].get("minReplicas", 1) if hpa else d["spec"].get("replicas", 1)
            total = (total or 0) + n
    return total


def check_values(m: Manifests) -> list[Problem]:
    problems = []
    for pdb in m.of("PodDisruptionBudget"):
        fewest = _fewest_replicas(m, pdb["spec"].get("selector") or {})
        least = pdb["spec"].get("minAvailable")
        if isinstance(least, int) and fewest is not None and least >= fewest:
            problems.append(Problem("values", where(pdb), f"minAvailable {least} of {fewest} replica(s): no node "
                                    "drain could ever evict one"))
    for cron in m.of("CronJob"):
        if not cron_ok(str(cron["spec"].get("schedule", ""))):
            problems.append(Problem("values", where(cron), f"schedule {cron['spec'].get('schedule')!r} is no cron"))
    for topic in m.of("KafkaTopic"):
        for key, value in (topic["spec"].get("config") or {}).items():
            allowed = _TOPIC_CONFIG.get(key)
            if allowed is int:
                if not re.fullmatch(r"-?[0-9]+", str(value)) or int(value) < -1:
                    problems.append(Problem("values", where(topic), f"{key}: {value!r} is not a whole number"))
            elif allowed is not None and str(value) not in allowed:
                problems.append(Problem("values", where(topic), f"{key}: {value!r} is not one of {sorted(allowed)}"))
    return problems
