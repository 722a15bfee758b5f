"""One `Settings` per process, read from the environment.

Every component reads the same settings; an empty value for a backing service
(Kafka, Redis, MLflow, the model) means "use the embedded default" that
`launcher.embedded` starts or creates.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from flywheel.write_keys import KeyScope, parse_write_keys

# Secrets (every `SecretStr` field): in development each has a default; in production each process holds only
# the secrets the environment gives it (k8s/ gives each component only the keys it reads), and each one given is
# at least this long, never its development default, never a placeholder of an example file. Values are never
# echoed: errors name the variable only.
MIN_SECRET_LENGTH = 24
# What an example or template secret looks like (k8s/overlays/prod/secrets.example, docs): copied and forgotten,
# it would start production on a value anyone can read.
_PLACEHOLDER = re.compile(r"^replace|example|changeme|change-me|change_me|placeholder|your[-_]|<[^>]*>",
                          re.IGNORECASE)
# Stores the lake's Delta tables open (`flywheel.lake`); a value without a scheme is a local path.
_LAKE_SCHEMES = frozenset({"file", "s3", "s3a", "gs", "az", "abfs", "abfss"})
# Secret fields holding a comma-separated list; each item is checked as one secret.
_LIST_SECRETS = frozenset({"write_keys", "serving_api_keys"})
# Secret fields whose empty value means "off" rather than "not set" (development: serving answers without a key).
_OPTIONAL_SECRETS = frozenset({"serving_api_keys"})
# Secret fields holding a URL; what production checks in one is its password.
_URL_SECRETS = frozenset({"token_store_url"})


class Settings(BaseSettings):
    """Configuration for every Flywheel process.

    Environment variables use the `FLYWHEEL_` prefix (`FLYWHEEL_DATA_DIR`), except
    the well-known service URLs, which also answer to their usual names
    (`KAFKA_BOOTSTRAP_SERVERS`, `REDIS_URL`, `MLFLOW_TRACKING_URI`).
    """

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_", extra="forbid", populate_by_name=True, hide_input_in_errors=True
    )

    environment: Literal["development", "production"] = Field(
        default="development",
        description="production refuses empty, short, development-default and placeholder secrets.",
    )
    data_dir: Path = Field(default=Path("var"), description="Lake, models, MLflow and embedded state.")
    lake_uri: str = Field(
        default="",
        description="Where the lake's Delta tables live: a local path or s3://BUCKET/PREFIX (credentials and "
        "endpoint from the AWS_* variables); empty: <data_dir>/lake.",
    )
    lake_log_retention_days: int = Field(
        default=365,
        ge=30,
        description="Days each lake table keeps its commit log (Delta's delta.logRetentionDuration): a table version "
        "older than this can no longer be opened, so a model trained on it can no longer be traced to its rows. At "
        "least Delta's 30-day default; about 1-2 KB of log a commit, kept this long (docs/design.md, 'Lake tables').",
    )

    # Kafka
    kafka_bootstrap_servers: str = Field(
        default="",
        validation_alias=AliasChoices("FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS", "KAFKA_BOOTSTRAP_SERVERS"),
        description="host:port[,host:port]; empty starts the embedded Tansu broker.",
    )
    kafka_client: Literal["kafka-python", "confluent"] = Field(
        default="kafka-python", description="Kafka client library: kafka-python, or confluent (librdkafka, faster)."
    )
    embedded_kafka_port: int = Field(
        default=19092, description="Loopback port of the broker `flywheel up` starts when no Kafka is configured."
    )
    topic_partitions: int = Field(
        default=4, ge=1,
        description="Partitions of each topic Flywheel creates: at most this many ingest or signals workers.",
    )
    events_topic: str = Field(
        default="flywheel.events", description="Product and generation events, keyed by generation_id."
    )
    rewards_topic: str = Field(
        default="flywheel.rewards", description="Reward records, one per generation and definition."
    )
    dead_letter_topic: str = Field(
        default="flywheel.dead-letter",
        description="Refused input with its reason and original bytes (credentials removed).",
    )
    # A cluster that enforces ACLs (Strimzi's KafkaUsers) knows each process by its SASL user.
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    kafka_sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] = Field(
        default="SCRAM-SHA-512", description="SASL mechanism when the protocol is SASL_*."
    )
    kafka_sasl_username: str = Field(default="", description="This process's Kafka user when the protocol is SASL_*.")
    kafka_sasl_password: SecretStr | None = Field(
        default=None, description="The SASL user's password; needed (with the username) when the protocol is SASL_*."
    )
    kafka_ssl_cafile: str = Field(
        default="",
        description="With SASL_SSL: a PEM file of the CA that signs the brokers' certificates (Strimzi's cluster CA, "
        "its `<cluster>-cluster-ca-cert` Secret's ca.crt); empty trusts the system's CAs. The host name is checked.",
    )

    # Redis
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("FLYWHEEL_REDIS_URL", "REDIS_URL"),
        description="When nothing answers here, an embedded Valkey server is started instead.",
    )
    redis_prefix: str = Field(
        default="flywheel:",
        description="Prefix of every Redis key Flywheel writes (deployments sharing one Redis differ here).",
    )

    # MLflow
    mlflow_tracking_uri: str = Field(
        default="",
        validation_alias=AliasChoices("FLYWHEEL_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI"),
        description="Empty: SQLite under data_dir with a local artifact folder.",
    )
    registered_model_name: str = Field(default="flywheel-policy", description="The model's name in MLflow's registry.")
    registry_max_chain: int = Field(
        default=8, ge=0,
        description="Deltas in a row before the registry stores a version's full weights again (0: always full).",
    )

    # Model
    model_path: str = Field(
        default="",
        description="A local Hugging Face causal LM checkpoint; empty bootstraps the embedded one.",
    )
    device: str = Field(default="cpu", description="Torch device of serving and the trainer: cpu, cuda or cuda:N.")
    serving_backend: Literal["hf", "vllm"] = Field(
        default="hf",
        description="What runs the model in serving: hf (in-process Hugging Face, the embedded default) or vllm "
        "(a vLLM server; docs/serving.md, \"Serving back ends\").",
    )
    sampling_backend: Literal["hf", "vllm"] = Field(
        default="hf",
        description="What runs the trainer's own samples and the offline gate's completions of logged prompts: hf "
        "(the in-process loop, the default) or vllm (vllm_url's server when it serves the version, else a vLLM "
        "server started on the checkpoint for the work; docs/serving.md, \"Generation work on the engine\").",
    )
    vllm_url: str = Field(
        default="",
        description="With serving_backend=vllm: your own vLLM server (started with --enable-lora, "
        "--logprobs-mode raw_logprobs, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); empty starts one per version.",
    )
    vllm_python: str = Field(
        default="",
        description="Interpreter of the vLLM servers serving starts; empty is the repo's .venv-vllm "
        "(scripts/install_vllm.sh).",
    )
    vllm_kv_cache_gb: int = Field(
        default=1, ge=1, description="KV cache of each vLLM server serving starts on CPU, in GiB."
    )

    # Services
    bind_host: str = Field(
        default="127.0.0.1",
        description="Interface every HTTP server binds (collector, serving, gate, trainer API, ingest metrics); "
        "0.0.0.0 serves other hosts (a product's back ends, Prometheus, a Kubernetes Service).",
    )
    http_keep_alive_s: int = Field(
        default=75, ge=1,
        description="Seconds every HTTP server keeps an idle client connection open. Longer than clients' own "
        "idle expiry (httpx 5 s, load balancers 60 s), so the client always closes first: a server closing a "
        "kept-alive connection just as a client sends on it resets that request.",
    )
    serving_port: int = Field(default=8000, description="Serving's HTTP API (OpenAI-compatible completions).")
    collector_port: int = Field(
        default=8001, description="The collector's HTTP doors (native, Segment, OTLP, PostHog)."
    )
    gate_port: int = Field(default=8002, description="The deploy gate's API and A/B dashboard.")
    trainer_port: int = Field(default=8003, description="The trainer scheduler's API (status, run a cycle now).")
    # The HTTP servers' /metrics on a port of its own (Kubernetes: the `metrics` port, the only one the monitoring
    # namespace may reach); 0 keeps it on the API's port, as `flywheel up` runs them.
    serving_metrics_port: int = Field(
        default=0, ge=0, le=65535,
        description="Serving's /metrics on this port instead of serving_port; 0: on serving_port.",
    )
    collector_metrics_port: int = Field(
        default=0, ge=0, le=65535,
        description="The collector's /metrics on this port instead of collector_port (shared by its --workers); "
        "0: on collector_port.",
    )
    gate_metrics_port: int = Field(
        default=0, ge=0, le=65535, description="The gate's /metrics on this port instead of gate_port; 0: on gate_port."
    )
    trainer_metrics_port: int = Field(
        default=0, ge=0, le=65535,
        description="The trainer scheduler's /metrics on this port instead of trainer_port; 0: on trainer_port.",
    )
    ingest_metrics_port: int = Field(default=9101, ge=0, description="Ingest worker /metrics and health; 0 = off.")
    signals_metrics_port: int = Field(default=9102, ge=0, description="Signals worker /metrics and health; 0 = off.")
    write_keys: SecretStr = Field(
        default=SecretStr("dev-write-key"),
        description="Comma-separated write keys the collector accepts (HTTP basic auth user); a key may be "
        "limited to sources and user-id prefixes: `KEY;source=web;user=acme:` (flywheel/write_keys.py).",
    )
    otlp_write_key_header: str = Field(
        default="x-flywheel-write-key",
        pattern=r"^[A-Za-z0-9-]{1,64}$",
        description="Header in which the collector's OTLP door also reads the write key (besides Authorization: "
        "Bearer or Basic); an HTTP header name of letters, digits and dashes.",
    )
    serving_key: SecretStr = Field(
        default=SecretStr("dev-serving-key"),
        description="HMAC key serving signs its generation events with; the trainer learns off-policy only "
        "from generations whose signature verifies under it. Serving and the trainer need the same key.",
    )
    serving_api_keys: SecretStr = Field(
        default=SecretStr(""),
        description="Comma-separated API keys serving's /v1 endpoints accept as `Authorization: Bearer` (several "
        "while one is rotated out). Empty: serving answers without a key (development only; in production serving "
        "refuses to start without one).",
    )
    approval_token: SecretStr = Field(
        default=SecretStr("dev-approval-token"),
        description="Bootstrap admin bearer token for the gate and trainer APIs (identity "
        "'admin (FLYWHEEL_APPROVAL_TOKEN)'); issue personal tokens with `flywheel gate tokens issue`.",
    )
    token_store_url: SecretStr | None = Field(
        default=None,
        description="SQLAlchemy URL of the issued-token store (hashes only); unset: SQLite under data_dir. "
        "Give the gate, its rollout controller and the trainer the same one (e.g. the PostgreSQL that holds "
        "MLflow). A secret: the URL carries the database password.",
    )
    collector_max_surfaces_per_key: int = Field(
        default=64,
        ge=1,
        description="Distinct surfaces one write key's generations may name per hour (each new one is a place in "
        "the reward pointer every reader follows); a generation naming one more is dead-lettered.",
    )
    collector_rate_limit: str = Field(
        default="200/second", description="Requests per client address the collector takes (429 beyond)."
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses or networks (CIDR) of the reverse proxies in front of the collector and the gate, "
        'as JSON (e.g. ["10.0.0.0/8"]): only a request from one of them has its X-Forwarded-For read, and the '
        "client a rate limit counts is the first address in it, from the right, that is not a trusted proxy. "
        "Empty: the peer's address, whatever a header says.",
    )
    gate_rate_limit: str = Field(
        default="100/second",
        description="Requests per client address the gate takes (429 beyond). One dashboard load is about 20 "
        "requests, and viewers behind one proxy share an address: 20/second refused a page reloaded at once.",
    )
    auto_approve: bool = Field(
        default=False,
        description="Approve pending candidates without a person (each approval audited as the "
        "'auto-approve policy'); off by default: a person approves.",
    )

    # Loop timing
    reward_window_s: float = Field(
        default=960.0,
        gt=0,
        description="Feedback window per generation, for surfaces whose reward definition names none; "
        "960 s covers code completion's 15-minute retention check after an accept within a minute.",
    )
    reward_windows_s: dict[str, float] = Field(
        default_factory=dict,
        description="Feedback window per surface, for surfaces whose reward definition names none, as JSON "
        '(e.g. {"chat": 300, "code-completion": 60}); a surface not named here uses reward_window_s.',
    )
    allowed_lateness_s: float = Field(
        default=5.0, ge=0,
        description="Seconds the signals watermark trails the latest arrival, so events produced slightly out of order "
        "still count in their window.",
    )
    # An event's time is a client's claim; arrival is ours. Outside this window around its arrival the collector
    # dead-letters it with the reason (a far-future time would otherwise close every window early).
    event_time_ahead_s: float = Field(
        default=24 * 3600.0, ge=0, description="How far after its arrival an event's time may be (clock skew)."
    )
    event_time_behind_s: float = Field(
        default=5 * 366 * 86400.0,
        gt=0,
        description="How far before its arrival an event's time may be (history imported late: five years).",
    )
    train_interval_s: float = Field(
        default=3 * 3600.0, gt=0, description="Seconds between the trainer scheduler's cycles."
    )
    trainer_stale_after_s: float = Field(
        default=1800.0, gt=0,
        description="Seconds a running training cycle may go without looking at its stop flag before the trainer's "
        "/healthz fails (a wedged cycle is restarted). It looks at least every optimizer step, scoring chunk and "
        "own-sample prompt; the longest stretch without a look is loading the champion and storing the candidate, "
        "which a large model on a slow disk can take minutes to do.",
    )
    min_train_samples: int = Field(
        default=32, ge=1,
        description="Fewest eligible samples a cycle trains on (TrainerConfig.min_samples overrides it).",
    )
    challenger_share: float = Field(
        default=0.2, gt=0, le=1,
        description="Share of users an approved challenger first gets (the rollout controller then ramps it).",
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, value: list[str]) -> list[str]:
        import ipaddress

        bad = []
        for text in value:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError:
                bad.append(text)
        if bad:
            raise ValueError(f"not an address or a network (CIDR): {bad}; write e.g. 10.0.0.0/8 or 192.0.2.7")
        return value

    @field_validator("collector_rate_limit", "gate_rate_limit")
    @classmethod
    def _rate(cls, value: str) -> str:
        from limits import parse

        try:
            parse(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a rate; write e.g. '200/second' or '1000/minute'") from None
        return value

    @field_validator("reward_windows_s")
    @classmethod
    def _positive_windows(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in value.items() if not v > 0}
        if bad:
            raise ValueError(f"every surface's window must be positive seconds; got {bad}")
        return value

    def window_for(self, surface: str) -> float:
        """The deployment's feedback window for `surface` (a definition's own `window_s` comes first).

        >>> Settings(reward_windows_s={"chat": 300}).window_for("chat")
        300.0
        >>> Settings(reward_window_s=60).window_for("code-completion")
        60.0
        """
        return float(self.reward_windows_s.get(surface, self.reward_window_s))

    @field_validator("kafka_bootstrap_servers", "mlflow_tracking_uri", "model_path")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    @field_validator("lake_uri")
    @classmethod
    def _lake_uri(cls, value: str) -> str:
        value = value.strip()
        scheme, sep, rest = value.partition("://")
        if sep and scheme not in _LAKE_SCHEMES:
            raise ValueError(f"FLYWHEEL_LAKE_URI: {scheme}:// is not a store the lake opens; use a local path or "
                             f"one of {', '.join(s + '://' for s in sorted(_LAKE_SCHEMES))} (e.g. s3://bucket/lake)")
        if sep and scheme != "file" and not rest.split("/")[0]:
            raise ValueError(f"FLYWHEEL_LAKE_URI names no bucket: write {scheme}://BUCKET/PREFIX")
        return value.removeprefix("file://")

    @field_validator("*", mode="before")
    @classmethod
    def _strip_secrets(cls, value: Any, info: ValidationInfo) -> Any:
        # A trailing newline from a mounted secret file must not become part of the token.
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and field.annotation in (SecretStr, SecretStr | None) and isinstance(value, str):
            return value.strip()
        return value

    @model_validator(mode="after")
    def _kafka_sasl_complete(self) -> Settings:
        if self.kafka_security_protocol.startswith("SASL_") and not (
            self.kafka_sasl_username and self.kafka_sasl_password is not None
        ):
            raise ValueError(
                f"FLYWHEEL_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs FLYWHEEL_KAFKA_SASL_USERNAME "
                "and FLYWHEEL_KAFKA_SASL_PASSWORD; set both, or PLAINTEXT for a cluster without authentication"
            )
        return self

    @model_validator(mode="after")
    def _check_secrets(self) -> Settings:
        """Every secret given is set; in production one not given is not held, and none given is short, still
        its development default, or a placeholder.

        In production a process holds only the secrets its environment gives it: one it is not given is empty
        here rather than its development default (the collector holds no serving key, serving no write keys),
        and what needs it finds nothing to accept or sign with. Messages name the variable, never its value
        (and `hide_input_in_errors` keeps pydantic from echoing the input).
        """
        problems = []
        production = self.environment == "production"
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if not isinstance(value, SecretStr):
                continue
            env = f"FLYWHEEL_{name.upper()}"
            if production and name not in self.model_fields_set:
                setattr(self, name, SecretStr(""))  # not given to this process: not held
                continue
            items = _secret_items(name, value)
            if name in _URL_SECRETS:
                items = [_url_password(item) for item in items]
            if not items and name in _OPTIONAL_SECRETS:
                continue  # off
            if not items:
                problems.append(f"{env} is empty; set a secret value")
            elif production:
                default = field.default if isinstance(field.default, SecretStr) else SecretStr("")
                if set(items) & set(_secret_items(name, default)):
                    problems.append(f"{env} still holds the development value; set a secret one")
                elif any(_PLACEHOLDER.search(item) for item in items):
                    problems.append(f"{env} is still a placeholder of an example file; set a secret value")
                elif any(len(item) < MIN_SECRET_LENGTH for item in items):
                    problems.append(f"{env} is too short for production")
        if production:
            # Plain settings whose URL may carry a password (a Redis ACL user's): never an example file's.
            for name, env in (("redis_url", "REDIS_URL"), ("mlflow_tracking_uri", "MLFLOW_TRACKING_URI")):
                password = _url_password(getattr(self, name))
                if password != getattr(self, name) and _PLACEHOLDER.search(password):
                    problems.append(f"{env}'s password is still a placeholder of an example file; set a secret one")
        if problems:
            raise ValueError(
                "; ".join(problems) + f" (production secrets need at least {MIN_SECRET_LENGTH} characters, "
                "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        return self

    @model_validator(mode="after")
    def _check_write_key_limits(self) -> Settings:
        self.write_key_scopes  # noqa: B018 - parsed now, so a malformed limit fails at start, not per request
        return self

    @property
    def serving_api_key_set(self) -> frozenset[str]:
        """The keys serving accepts; empty: it answers without one."""
        return frozenset(_secret_items("serving_api_keys", self.serving_api_keys))

    @property
    def write_key_set(self) -> frozenset[str]:
        return frozenset(self.write_key_scopes)

    @property
    def write_key_scopes(self) -> dict[str, KeyScope]:
        """Each write key and what it may speak for (`flywheel.write_keys`)."""
        return parse_write_keys(_secret_items("write_keys", self.write_keys))

    @property
    def lake_dir(self) -> Path:
        """The embedded lake's folder (its tables and reward definitions live under `lake_root`)."""
        return self.data_dir / "lake"

    @property
    def lake_root(self) -> str:
        """The lake's root: `lake_uri`, or the embedded `lake_dir`."""
        return self.lake_uri or str(self.lake_dir.resolve())

    @property
    def embedded_mlflow_uri(self) -> str:
        return f"sqlite:///{(self.data_dir / 'mlflow' / 'mlflow.db').resolve()}"

    @property
    def resolved_mlflow_uri(self) -> str:
        return self.mlflow_tracking_uri or self.embedded_mlflow_uri


def _url_password(url: str) -> str:
    """The password a database URL carries (what must be secret in it); the whole URL when it has none.

    >>> _url_password("postgresql+psycopg2://mlflow:s3cr3t@db:5432/flywheel")
    's3cr3t'
    >>> _url_password("sqlite:////var/lib/flywheel/tokens.db")
    'sqlite:////var/lib/flywheel/tokens.db'
    """
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return password if password else url


def _secret_items(name: str, value: SecretStr) -> list[str]:
    raw = value.get_secret_value()
    if name in _LIST_SECRETS:
        return [k.strip() for k in raw.split(",") if k.strip()]
    return [raw] if raw.strip() else []


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once from the environment)."""
    return Settings()
