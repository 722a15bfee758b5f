"""k8s/ checked offline as strictly as a cluster would: both overlays build, every built-in kind validates
strictly, every custom resource against its published CRD schema, every semantic check passes (see
tests/k8s_checks/), the Dockerfile lints clean and runs unprivileged, promtool accepts the alerts; and
every deliberately broken overlay in tests/k8s_broken/ fails the check it is named after, which is what
shows the checks check.

Tools come from the k8s extra (kubectl, kubernetes-validate, hadolint) and Debian's prometheus package
(promtool, installed by scripts/install.sh when it can); the CRD schemas from ../shared/k8s-crds (or
FLYWHEEL_K8S_CRDS). Each skips with its reason when missing, except the CRD schemas in CI (CI or
FLYWHEEL_REQUIRE_CRDS set): there a missing folder fails, so custom resources are never left unchecked.

"prod" here is the production overlay with its on-demand training job (overlays/prod-training, a superset of
what a deploy applies), built with secrets.example's placeholders filled in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import k8s_checks as kc
from tests.k8s_checks.network import Peer, allowed, metrics_ports
from tests.k8s_checks.objects import containers
from tests.k8s_checks.security import SECRET_SETTINGS, SECRETS_READ, secrets_read
from tests.k8s_checks.security import cron_ok as kc_cron_ok

pytestmark = pytest.mark.skipif(kc.tool("kubectl") is None, reason="kubectl missing: pip install -e '.[k8s]'")

BROKEN = Path(__file__).parent / "k8s_broken"
CASES = sorted(p.name for p in BROKEN.iterdir() if (p / "kustomization.yaml").exists())


# The commands that read or write the lake.
LAKE_COMMANDS = {("ingest", "worker"), ("signals", "worker"), ("gate", "serve"), ("gate", "rollout"),
                 ("trainer", "schedule"), ("trainer", "run-once"), ("lake", "compact")}


@pytest.fixture(scope="module")
def dev() -> kc.Manifests:
    return kc.build(kc.K8S / "overlays" / "dev")


@pytest.fixture(scope="module")
def prod_overlays(tmp_path_factory: pytest.TempPathFactory) -> tuple[kc.Manifests, kc.Manifests]:
    """(what a deploy applies: overlays/prod, the same with the training job: overlays/prod-training)."""
    with kc.prod_with_example_secrets(tmp_path_factory.mktemp("prod")) as overlay:
        return kc.build(overlay), kc.build(overlay.parent / "prod-training")


@pytest.fixture(scope="module")
def gpu_applied(tmp_path_factory: pytest.TempPathFactory) -> kc.Manifests:
    """overlays/gpu as a deploy applies it: prod with generation on a vLLM server and an adapter trained per cycle."""
    with kc.prod_with_example_secrets(tmp_path_factory.mktemp("gpu")) as overlay:
        return kc.build(overlay.parent / "gpu")


@pytest.fixture(scope="module")
def gpu(gpu_applied: kc.Manifests, prod_overlays: tuple[kc.Manifests, kc.Manifests]) -> kc.Manifests:
    """overlays/gpu with prod's on-demand training job beside it, checked as prod is (its peers' policy is prod's)."""
    applied, training = prod_overlays
    return kc.Manifests(gpu_applied.docs + [d for d in training.docs if d not in applied.docs])


@pytest.fixture(scope="module")
def prod(prod_overlays: tuple[kc.Manifests, kc.Manifests]) -> kc.Manifests:
    return prod_overlays[1]


def _crds_required() -> bool:
    return bool(os.environ.get("CI") or os.environ.get("FLYWHEEL_REQUIRE_CRDS"))


def _no_crds(reason: str) -> None:
    if _crds_required():
        pytest.fail(f"{reason}; CI requires them (CI or FLYWHEEL_REQUIRE_CRDS is set): set FLYWHEEL_K8S_CRDS")
    pytest.skip(reason)


@pytest.fixture(params=["dev", "prod", "gpu"])
def built(request: pytest.FixtureRequest) -> kc.Manifests:
    return request.getfixturevalue(request.param)


def test_overlays_hold_the_whole_loop(dev: kc.Manifests, prod: kc.Manifests) -> None:
    for m in (dev, prod):
        apps = {tpl["metadata"]["labels"].get("app") for _, tpl in m.workloads()}
        assert {"collector", "serving", "ingest-worker", "signals-worker", "gate", "rollout", "trainer",
                "lake-compaction", "lake-vacuum-full", "init", "valkey", "postgres", "mlflow", "mlflow-migrate",
                "mlflow-read"} <= apps
        assert {t["spec"]["topicName"] for t in m.of("KafkaTopic")} == {
            "flywheel.events", "flywheel.rewards", "flywheel.dead-letter"}
        # The lake is on object storage: no volume for it, and every process on it is told where it is.
        assert m.get("PersistentVolumeClaim", "flywheel-lake") is None
        assert not [v for _, tpl in m.workloads() for v in tpl["spec"].get("volumes", [])
                    if "persistentVolumeClaim" in v and "lake" in v["persistentVolumeClaim"]["claimName"]]
        for owner, c in containers(m):
            if tuple((kc.flywheel_args(c) or [])[:2]) in LAKE_COMMANDS:
                env = kc.environment(m, c)
                assert env.get("FLYWHEEL_LAKE_URI", "").startswith("s3://"), owner["metadata"]["name"]
                assert env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY") and env.get("AWS_REGION")
    assert dev.pods_by_app("minio") and not prod.pods_by_app("minio")
    assert prod.of("PodDisruptionBudget") and prod.of("PyTorchJob")
    gpu = [c for _, tpl in prod.workloads() for c in tpl["spec"]["containers"]
           if "nvidia.com/gpu" in c["resources"].get("limits", {})]
    assert {c["name"] for c in gpu} == {"serving", "trainer", "pytorch"}


def test_builtin_kinds_validate_strictly_and_custom_resources_against_their_crds(built: kc.Manifests) -> None:
    crds = kc.crd_dir()
    problems = kc.check_schemas(built, crds)
    assert not problems, "\n".join(map(str, problems))
    if crds is None:
        _no_crds("../shared/k8s-crds is absent (or FLYWHEEL_K8S_CRDS unset): custom resources not validated")


@pytest.mark.parametrize("check", sorted(kc.CHECKS))
def test_semantic_check_passes(built: kc.Manifests, check: str) -> None:
    problems = kc.CHECKS[check](built)
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("case", CASES)
def test_each_broken_overlay_fails_its_check(case: str, dev: kc.Manifests) -> None:
    check = case.split(".")[0]
    m = kc.build(BROKEN / case)
    if check == "schemas":
        crds = kc.crd_dir()
        if crds is None and case != "schemas.builtin-field":
            _no_crds("../shared/k8s-crds is absent: custom resources and unknown kinds are not decided")
        # What dev holds unchanged has passed already (test above): validate what the case changed.
        changed = [d for d in m.docs if d not in dev.docs]
        assert changed
        problems = kc.check_schemas(kc.Manifests(changed), crds)
    else:
        problems = kc.CHECKS[check](m)
    assert problems, f"{case}: the {check} check passed a broken overlay"
    assert all(p.check == check for p in problems)


def test_lake_maintenance_reaches_mlflow_and_a_full_vacuum_is_scheduled(prod: kc.Manifests) -> None:
    # Both ask the registry which table versions models trained on before deleting anything (launcher/lake.py).
    mlflow = prod.pods_by_app("mlflow")
    runs = {}
    for cron in prod.of("CronJob"):
        tpl = cron["spec"]["jobTemplate"]["spec"]["template"]
        args = kc.flywheel_args(tpl["spec"]["containers"][0]) or []
        if args[:1] == ["lake"]:
            runs[tuple(args)] = cron
            pod = next(p for p in prod.pods if p.owner == f"CronJob/{cron['metadata']['name']}")
            assert mlflow and all(allowed(prod, Peer(pod.labels, pod=pod), Peer(m.labels, pod=m), 5000)
                                  for m in mlflow), f"{cron['metadata']['name']} cannot reach MLflow"
    assert ("lake", "compact") in runs  # hourly: compaction, then the vacuum within the retention
    full = runs.get(("lake", "vacuum", "--full"))
    assert full is not None, "no CronJob runs the full vacuum (orphaned files of lost commits)"
    assert kc_cron_ok(full["spec"]["schedule"]) and full["spec"]["concurrencyPolicy"] == "Forbid"
    alerts = {r["alert"]: r["expr"] for g in prod.of("PrometheusRule")[0]["spec"]["groups"] for r in g["rules"]}
    assert 'kube_job_failed{condition="true"' in alerts["FlywheelMaintenanceJobFailed"]
    assert "flywheel-lake-vacuum-full" in alerts["FlywheelFullVacuumStale"]
    assert re.search("flywheel-lake-", alerts["FlywheelMaintenanceJobFailed"])


def test_monitoring_reaches_metrics_ports_only(built: kc.Manifests) -> None:
    """Every process Prometheus scrapes serves /metrics on a port of its own named `metrics`, and the monitoring
    namespace reaches no other port of any pod (an API's port, a database's), the collector's public one aside."""
    prometheus = Peer(namespace={"kubernetes.io/metadata.name": "monitoring"})
    anyone = Peer(namespace={"kubernetes.io/metadata.name": "elsewhere"})
    servers = {"collector", "serving", "ingest-worker", "signals-worker", "gate", "rollout", "trainer"}
    for pod in built.pods:
        metrics = metrics_ports(built, pod)
        if pod.labels.get("app") in servers:
            assert metrics, f"{pod.owner}: no metrics port"
        for port in sorted(set(pod.ports.values()) - metrics):
            dst = Peer(pod.labels, pod=pod)
            assert not allowed(built, prometheus, dst, port) or allowed(built, anyone, dst, port), (
                f"monitoring reaches {pod.owner}:{port}, which is no metrics port")
    for sm in built.of("ServiceMonitor"):
        assert {ep.get("port") for ep in sm["spec"]["endpoints"]} == {"metrics"}, sm["metadata"]["name"]


def test_no_rendered_manifest_sets_a_field_an_autoscaler_or_operator_owns(
    dev: kc.Manifests, prod_overlays: tuple[kc.Manifests, kc.Manifests]
) -> None:
    applied, training = prod_overlays
    for m in (dev, applied, training):
        assert not kc.CHECKS["ownership"](m)
    for m in (dev, applied):
        scaled = {h["spec"]["scaleTargetRef"]["name"] for h in m.of("HorizontalPodAutoscaler")}
        assert {"flywheel-collector", "flywheel-serving"} <= scaled
        assert all("replicas" not in m.get("Deployment", name)["spec"] for name in scaled)  # type: ignore[index]
    # A deploy starts no training run; a run is a job created from overlays/prod-training.
    assert not applied.of("PyTorchJob") and training.of("PyTorchJob")
    assert [d for d in training.docs if d["kind"] != "PyTorchJob"] == applied.docs
    job = training.of("PyTorchJob")[0]
    assert "suspend" not in job["spec"]["runPolicy"]
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "training"  # what `kubectl create -l` takes
    images = {c["image"] for spec in job["spec"]["pytorchReplicaSpecs"].values()
              for c in spec["template"]["spec"]["containers"]}
    trainer = applied.get("Deployment", "flywheel-trainer")["spec"]["template"]["spec"]["containers"][0]["image"]  # type: ignore[index]
    assert images == {trainer}  # the trainer's image, bumped in overlays/prod's images: only


def test_every_rendered_pod_passes_pod_security_restricted(built: kc.Manifests) -> None:
    assert not kc.CHECKS["pod-security"](built)
    pods = [tpl["spec"] for _, tpl in built.workloads()]
    assert pods and all(p["automountServiceAccountToken"] is False for p in pods)
    ns = built.of("Namespace")[0]["metadata"]["labels"]
    assert ns["pod-security.kubernetes.io/enforce"] == "restricted"


def test_no_secret_value_appears_outside_secret_objects(built: kc.Manifests) -> None:
    assert not kc.CHECKS["secrets"](built)


def test_each_component_gets_only_the_secret_keys_its_settings_read(
    built: kc.Manifests, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flywheel.settings import Settings

    seen = set()
    for owner, c in containers(built):
        args = kc.flywheel_args(c)
        if args is None:
            continue
        wanted = secrets_read(args)
        assert wanted is not None, f"{owner['metadata']['name']}: flywheel {' '.join(args)}"
        assert not [s for s in c.get("envFrom", []) if "secretRef" in s], owner["metadata"]["name"]
        env = kc.environment(built, c)
        assert SECRET_SETTINGS & set(env) == wanted, owner["metadata"]["name"]
        # As the process sees them in production: it holds exactly those, and none at a default.
        for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            if key.startswith("FLYWHEEL_") and (key in SECRET_SETTINGS or key == "FLYWHEEL_ENVIRONMENT"):
                monkeypatch.setenv(key, value)
        settings = Settings()
        fields = ("write_keys", "serving_key", "serving_api_keys", "approval_token", "token_store_url")
        held = {f"FLYWHEEL_{name.upper()}" for name in fields
                if (v := getattr(settings, name)) is not None and v.get_secret_value()}
        if settings.environment == "production":
            assert held == wanted, owner["metadata"]["name"]
        seen.add(tuple(args[:2]))
    assert {("ingest", "collector"), ("serve",), ("gate", "serve"), ("lake", "compact")} <= seen


# How the code reads each secret setting: the field, or the names that read it for their caller (the write keys'
# parsed sets; the approval token and the token store through flywheel.identity's Authenticator and store).
_READ_BY = {
    "FLYWHEEL_WRITE_KEYS": r"\.write_key(s|_set|_scopes)\b",
    "FLYWHEEL_SERVING_KEY": r"\.serving_key\b",
    "FLYWHEEL_SERVING_API_KEYS": r"\.serving_api_key(s|_set)\b",
    "FLYWHEEL_APPROVAL_TOKEN": r"\.approval_token\b|\bAuthenticator\(",
    "FLYWHEEL_TOKEN_STORE_URL": r"\.token_store_url\b|\bstore_url\(|\bAuthenticator\(|\bAuditLog\b",
}
# Where a command's code lives, and the secrets its package reads that the command itself does not, with why.
_CODE = {"serve": "serving", "ingest": "ingest", "signals": "signals", "gate": "deploy_gate", "trainer": "trainer"}
_NOT_READ = {
    (("ingest", "collector"), "FLYWHEEL_SERVING_KEY"): "scrubbed from dead letters only if held; it is not given",
    (("ingest", "collector"), "FLYWHEEL_APPROVAL_TOKEN"): "the same",
    (("ingest", "worker"), "FLYWHEEL_WRITE_KEYS"): "the collector's doors only",
    (("ingest", "worker"), "FLYWHEEL_SERVING_KEY"): "the collector's scrubber only",
    (("ingest", "worker"), "FLYWHEEL_APPROVAL_TOKEN"): "the collector's scrubber only",
    (("trainer", "run-once"), "FLYWHEEL_APPROVAL_TOKEN"): "the scheduler's HTTP API only (trainer/api.py)",
    (("trainer", "run-once"), "FLYWHEEL_TOKEN_STORE_URL"): "the same",
}


def test_the_secrets_each_command_gets_follow_the_code_that_reads_them() -> None:
    """SECRETS_READ (what the secret-keys check gives each command) against the packages' source: a package
    that starts reading a secret fails here until its commands get it, or say why not."""
    for command, given in sorted(SECRETS_READ.items()):
        package = _CODE.get(command[0])
        if package is None:
            continue
        code = "\n".join(p.read_text() for p in (kc.REPO / package).rglob("*.py"))
        read = {var for var, pattern in _READ_BY.items() if re.search(pattern, code)}
        unexplained = read - given - {var for (cmd, var) in _NOT_READ if cmd == command}
        assert not unexplained, f"flywheel {' '.join(command)}: {package}/ reads {sorted(unexplained)}"
        assert given <= read, f"flywheel {' '.join(command)} gets {sorted(given - read)}, which {package}/ never reads"


def test_every_image_is_bumped_in_one_place(built: kc.Manifests) -> None:
    """Each image a pod runs is set by a kustomization's `images:` (base for the engines, the overlay for
    Flywheel's and dev's MinIO), never by a tag written in a manifest."""
    named = set()
    for k in ("base", "overlays/dev", "overlays/prod", "overlays/gpu"):
        for entry in yaml.safe_load((kc.K8S / k / "kustomization.yaml").read_text()).get("images", []):
            named |= {entry["name"], entry.get("newName", entry["name"])}
    for owner, c in containers(built):
        image = c["image"].split("@")[0]
        name = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
        assert name in named, f"{owner['metadata']['name']}: {c['image']} is not set by any images:"
    for path in (kc.K8S / "base").rglob("*.yaml"):
        assert not re.search(r"^\s*image: \S+:\S+", path.read_text(), flags=re.MULTILINE), path


def test_prod_runs_only_images_pinned_by_digest_and_dev_by_tag(
    dev: kc.Manifests, prod: kc.Manifests, gpu: kc.Manifests
) -> None:
    """Prod's namespace asks for digests, so the images check refuses a tag alone there (images.digest shows it);
    the repository's digests are the documented placeholder until an operator pins real images."""
    from tests.k8s_checks.objects import PLACEHOLDER_DIGEST, pinned

    assert pinned(prod) and pinned(gpu) and not pinned(dev)  # dev runs images loaded into kind by tag
    for m in (prod, gpu):
        images = {c["image"] for _, c in containers(m)}
        assert images and all(i.endswith("@" + PLACEHOLDER_DIGEST) for i in images), images
        assert all(re.search(r":[^/@]+@", i) for i in images)  # the tag stays beside it, for people


def test_every_check_has_a_broken_overlay() -> None:
    assert {c.split(".")[0] for c in CASES} == set(kc.CHECKS) | {"schemas"}


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    hadolint = kc.tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint missing: pip install -e '.[k8s]'")
    return subprocess.run([hadolint, "--no-color", "--failure-threshold", "error", str(path)],
                          capture_output=True, text=True, timeout=60)


def _runs_as_root(dockerfile: Path) -> bool:
    users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), flags=re.MULTILINE)
    return not users or users[-1].split(":")[0] in ("root", "0")


def test_dockerfile_lints_clean_and_runs_unprivileged_on_the_pinned_versions() -> None:
    dockerfile = kc.REPO / "Dockerfile"
    result = _hadolint(dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not _runs_as_root(dockerfile)
    text = dockerfile.read_text()
    installs = re.findall(r"pip install[^\n;]*", text)
    assert installs and all("-c constraints.txt" in line for line in installs)
    assert "cpu)" in text and "cuda)" in text  # both variants, chosen by --build-arg VARIANT


def test_broken_dockerfiles_fail() -> None:
    assert _hadolint(BROKEN / "files" / "Dockerfile.hadolint").returncode != 0
    root = BROKEN / "files" / "Dockerfile.root"
    assert _hadolint(root).returncode == 0 and _runs_as_root(root)


def _promtool(rules: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    promtool = kc.tool("promtool")
    if promtool is None:
        pytest.skip("promtool missing: Debian's prometheus package (scripts/install.sh installs it as root)")
    path = tmp_path / "rules.yaml"
    path.write_text(rules)
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_alerts_and_refuses_a_broken_one(dev: kc.Manifests, tmp_path: Path) -> None:
    result = _promtool(kc.prometheus_rules(dev), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = kc.Manifests(list(yaml.safe_load_all((BROKEN / "files" / "prometheusrule.yaml").read_text())))
    assert _promtool(kc.prometheus_rules(broken), tmp_path).returncode != 0


def _exported_metrics() -> set[str]:
    """Names of the Prometheus metrics the packages define (as exported: counters get _total)."""
    names = set()
    for pkg in ("flywheel", "ingest", "signals", "trainer", "deploy_gate", "serving"):
        for path in (kc.REPO / pkg).rglob("*.py"):
            for kind, name in re.findall(r"\b(Counter|Gauge|Histogram)\(\s*\"(flywheel_[a-z_]+)\"", path.read_text()):
                base = name.removesuffix("_total")
                names |= {f"{base}_total"} if kind == "Counter" else {name}
                if kind == "Histogram":
                    names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_alerts_and_dashboard_read_series_the_processes_export(dev: kc.Manifests) -> None:
    exported = _exported_metrics()
    dashboard = json.loads(dev.data("ConfigMap", "flywheel-grafana-dashboard")["flywheel-dashboard.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in dev.of("PrometheusRule")[0]["spec"]["groups"] for r in g["rules"]]
    used = {name for e in exprs for name in re.findall(r"\bflywheel_[a-z_]+", e)}
    assert used and used <= exported, f"not exported by any process: {sorted(used - exported)}"
    alerts = {r["alert"] for g in dev.of("PrometheusRule")[0]["spec"]["groups"] for r in g["rules"]}
    assert {"FlywheelIngestLag", "FlywheelDeadLetterRate", "FlywheelNoRewards", "FlywheelTrainingCycleFailed",
            "FlywheelRollback", "FlywheelServingErrors"} <= alerts


def test_gpu_overlay_serves_on_a_vllm_sidecar_with_runtime_adapters_and_trains_adapters(
    gpu_applied: kc.Manifests, prod_overlays: tuple[kc.Manifests, kc.Manifests]
) -> None:
    """overlays/gpu (issue 45's deployment): each serving pod generates on its own vLLM engine, which holds the
    GPU, serves the base under the name serving routes to and loads adapters at runtime from paths serving hands
    it; the trainer writes an adapter per cycle. Everything else is prod's, unchanged."""
    m = gpu_applied
    serving = m.get("Deployment", "flywheel-serving")["spec"]["template"]["spec"]  # type: ignore[index]
    engine = next(c for c in serving["initContainers"] if c["name"] == "vllm")
    main = next(c for c in serving["containers"] if c["name"] == "serving")
    env = kc.environment(m, main)
    assert env["FLYWHEEL_SERVING_BACKEND"] == "vllm"
    port = int(env["FLYWHEEL_VLLM_URL"].removeprefix("http://127.0.0.1:"))  # the pod's own engine, on loopback
    assert engine["restartPolicy"] == "Always" and engine["ports"][0]["containerPort"] == port
    args = engine["command"] + engine["args"]
    assert {"--enable-lora", "--logprobs-mode=raw_logprobs", f"--port={port}"} <= set(args)
    engine_env = {e["name"]: e["value"] for e in engine["env"]}
    assert engine_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and engine_env["HF_HUB_OFFLINE"] == "1"
    # The GPU is the engine's; serving's own container runs on the CPU image.
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in main["resources"]["limits"] and "cuda" not in main["image"]
    assert env["FLYWHEEL_DEVICE"] == "cpu"
    # An adapter's path is the one serving fetched it to: the engine mounts serving's data folder at the same
    # place, read-only, and the base from the volume the init Job registers it from.
    mounts = {v["name"]: v for v in engine["volumeMounts"]}
    data = next(v for v in main["volumeMounts"] if v["name"] == "data")
    assert mounts["data"]["mountPath"] == data["mountPath"] and mounts["data"]["readOnly"] is True
    volumes = {v["name"]: v for v in serving["volumes"]}
    assert volumes["base-model"]["persistentVolumeClaim"]["claimName"] == "flywheel-base-model"
    assert args[:3] == ["vllm", "serve", mounts["base-model"]["mountPath"] + "/base"]
    # The trainer trains adapters.
    trainer = m.get("Deployment", "flywheel-trainer")["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]
    path = trainer["args"][trainer["args"].index("--config") + 1]
    config = kc.mounted_file(m, m.get("Deployment", "flywheel-trainer"), trainer, path)  # type: ignore[arg-type]
    assert config is not None and json.loads(config)["update"] == "lora"
    # vLLM refuses an adapter of a higher rank than it reserved room for.
    max_rank = int(next(a for a in args if a.startswith("--max-lora-rank=")).split("=")[1])
    assert json.loads(config).get("lora_rank", 16) <= max_rank
    # Only serving's Deployment and the trainer's differ from prod's (and the trainer's config is new).
    applied = prod_overlays[0]
    changed = {f"{d['kind']}/{d['metadata']['name']}" for d in m.docs if d not in applied.docs}
    assert {c for c in changed if not c.startswith("ConfigMap/flywheel-")} == {
        "Deployment/flywheel-serving", "Deployment/flywheel-trainer"}


def _proxy_passes(conf: str, method: str, path: str) -> bool:
    """Whether the read-only proxy's nginx.conf passes `method path` upstream, by nginx's location rules as this
    config uses them: an exact `location =` first, then `location ~` regexes in order, then the prefix `/`; a
    `limit_except` inside the chosen location refuses the methods it does not list (GET brings HEAD)."""
    blocks = re.findall(r"location\s+(=|~)?\s*(\S+)\s*\{((?:[^{}]|\{[^{}]*\})*)\}", conf)
    chosen = next((body for kind, where, body in blocks if kind == "=" and where == path), None)
    if chosen is None:
        chosen = next((body for kind, where, body in blocks if kind == "~" and re.search(where, path)), None)
    if chosen is None:
        chosen = next(body for kind, where, body in blocks if not kind and path.startswith(where))
    if "proxy_pass" not in chosen:
        return False
    limit = re.search(r"limit_except\s+([A-Z ]+)\{", chosen)
    if limit is None:
        return True
    listed = set(limit.group(1).split())
    return method in listed | ({"HEAD"} if "GET" in listed else set())


def test_the_registry_proxy_passes_every_read_and_refuses_every_registry_write(dev: kc.Manifests) -> None:
    """Serving and the signals workers reach MLflow only through flywheel-mlflow-read (the network-flows check);
    here, over MLflow's own route table, that proxy passes each model-registry read and refuses each registry write
    (an alias moved, a version registered, a tag set), and passes the tracking API (a refit logs its runs)."""
    from mlflow.server.handlers import get_endpoints

    conf = dev.data("ConfigMap", "flywheel-mlflow-read")["nginx.conf"]  # type: ignore[index]
    registry = re.compile(r"registered_model|model_version|latest_versions|transition_stage")
    seen = {"read": 0, "write": 0, "tracking": 0}
    for path, handler, methods in get_endpoints():
        name = getattr(handler, "__name__", "")
        for method in methods:
            passes = _proxy_passes(conf, method, path)
            if registry.search(name):
                read = name.startswith(("_get", "_search"))
                assert passes == read, f"{method} {path} ({name}): {'refused' if read else 'passed'}"
                seen["read" if read else "write"] += 1
            elif path.startswith(("/api/2.0/mlflow/runs/", "/api/2.0/mlflow/experiments/")):
                assert passes, f"{method} {path} ({name}) refused: the signals workers log their refits' runs"
                seen["tracking"] += 1
    assert seen["read"] >= 10 and seen["write"] >= 20 and seen["tracking"] >= 20, seen
    assert not _proxy_passes(conf, "POST", "/api/2.0/mlflow/registered-models/alias")
    assert _proxy_passes(conf, "GET", "/api/2.0/mlflow/registered-models/alias")
