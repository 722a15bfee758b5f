"""Secrets in Settings: never empty, long and non-default in production, never echoed in an error."""

from __future__ import annotations

import os

import pytest
from pydantic import SecretStr, ValidationError

from flywheel.settings import MIN_SECRET_LENGTH, Settings

GOOD = "k" * MIN_SECRET_LENGTH
SECRET_FIELDS = [name for name, f in Settings.model_fields.items() if f.annotation is SecretStr]
# Secrets whose empty default means "off" (serving's API keys: development answers without a key).
OPTIONAL = [name for name in SECRET_FIELDS if not Settings.model_fields[name].default.get_secret_value()]
REQUIRED = [name for name in SECRET_FIELDS if name not in OPTIONAL]


def production(**overrides: str) -> Settings:
    """Production settings with every secret set to a good value, then `overrides` applied."""
    values: dict[str, str] = {name: f"{name}-{GOOD}" for name in SECRET_FIELDS}
    values.update(overrides)
    return Settings(environment="production", **values)  # type: ignore[arg-type]


def test_the_secret_fields_are_the_expected_ones() -> None:
    # If a secret were added as a plain str it would escape every check below.
    assert {"approval_token", "write_keys", "serving_key"} <= set(SECRET_FIELDS)
    assert production().approval_token.get_secret_value() == f"approval_token-{GOOD}"


def test_the_optional_secrets_are_off_when_empty_in_either_environment() -> None:
    assert OPTIONAL == ["serving_api_keys"]
    assert Settings().serving_api_key_set == frozenset()
    assert production(serving_api_keys="").serving_api_key_set == frozenset()
    keys = production(serving_api_keys=f"a-{GOOD}, b-{GOOD}").serving_api_key_set
    assert keys == {f"a-{GOOD}", f"b-{GOOD}"}  # a list: the new key beside the old one while rotating


@pytest.mark.parametrize("field", REQUIRED)
@pytest.mark.parametrize("environment", ["development", "production"])
def test_an_empty_secret_is_refused_at_load_and_never_echoed(field: str, environment: str) -> None:
    for empty in ("", "   ", "\n"):
        with pytest.raises(ValidationError, match=f"FLYWHEEL_{field.upper()} is empty"):
            if environment == "production":
                production(**{field: empty})
            else:
                Settings(**{field: empty})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", SECRET_FIELDS)
def test_a_short_or_default_secret_is_refused_in_production_without_its_value(field: str) -> None:
    short = "hunter2-but-too-short"  # 21 characters
    with pytest.raises(ValidationError) as err:
        production(**{field: short})
    assert f"FLYWHEEL_{field.upper()} is too short" in str(err.value)
    assert short not in str(err.value) and short not in repr(err.value)
    default = Settings.model_fields[field].default.get_secret_value()
    if not default:  # an optional secret: its development value is "off", which production may hold
        return
    with pytest.raises(ValidationError, match="development value") as err:
        production(**{field: default})
    assert default not in str(err.value)


def test_each_write_key_is_checked_and_a_trailing_newline_is_not_part_of_a_secret() -> None:
    s = production(write_keys=f" {GOOD}a , {GOOD}b ,", approval_token=f"{GOOD}\n")
    assert s.write_key_set == {f"{GOOD}a", f"{GOOD}b"}
    assert s.approval_token.get_secret_value() == GOOD
    with pytest.raises(ValidationError, match="FLYWHEEL_WRITE_KEYS is too short") as err:
        production(write_keys=f"{GOOD},short-key-value")
    assert "short-key-value" not in str(err.value)


def test_an_empty_production_token_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_ENVIRONMENT", "production")
    for name in SECRET_FIELDS:  # every other secret is good, so only the token is in question
        monkeypatch.setenv(f"FLYWHEEL_{name.upper()}", f"{name}-{GOOD}")
    monkeypatch.setenv("FLYWHEEL_APPROVAL_TOKEN", "")
    with pytest.raises(ValidationError, match="FLYWHEEL_APPROVAL_TOKEN is empty"):
        Settings()
    leaked = "env-token-too-short"
    monkeypatch.setenv("FLYWHEEL_APPROVAL_TOKEN", leaked)
    with pytest.raises(ValidationError) as err:
        Settings()
    assert leaked not in str(err.value)
    monkeypatch.setenv("FLYWHEEL_APPROVAL_TOKEN", "x" * 40)
    assert "x" * 40 not in repr(Settings()) and "x" * 40 not in str(Settings().model_dump())


def test_an_invalid_value_next_to_a_secret_does_not_echo_the_input() -> None:
    with pytest.raises(ValidationError) as err:
        Settings(approval_token=f"{GOOD}-visible?", topic_partitions="many")  # type: ignore[arg-type]
    assert "visible?" not in str(err.value) and "many" not in str(err.value)


@pytest.mark.parametrize("placeholder", [
    "REPLACE-with-the-hmac-key-serving-signs-generations-with",  # k8s/overlays/prod/secrets.example
    "replace-me-0123456789abcdefghijklmnop",
    "an-example-secret-0123456789abcdefghij",
    "changeme-changeme-changeme-changeme",
    "<generate-one-with-python-secrets-token>",
])
@pytest.mark.parametrize("field", SECRET_FIELDS)
def test_production_refuses_a_placeholder_secret_without_its_value(field: str, placeholder: str) -> None:
    with pytest.raises(ValidationError, match=f"FLYWHEEL_{field.upper()} is still a placeholder") as err:
        production(**{field: placeholder})
    assert placeholder not in str(err.value)


def test_the_token_store_url_is_a_secret_whose_password_production_checks() -> None:
    url = f"postgresql+psycopg2://mlflow:{GOOD}@flywheel-postgres:5432/flywheel"
    s = production(token_store_url=url)
    assert isinstance(s.token_store_url, SecretStr) and s.token_store_url.get_secret_value() == url
    assert GOOD not in repr(s) and GOOD not in str(s.model_dump())
    for password, why in (("REPLACE-postgres-password", "placeholder"), ("pw-0123", "too short")):
        leaked = f"postgresql+psycopg2://mlflow:{password}@flywheel-postgres:5432/flywheel"
        with pytest.raises(ValidationError, match=f"FLYWHEEL_TOKEN_STORE_URL .*{why}") as err:
            production(token_store_url=leaked)
        assert password not in str(err.value)
    assert Settings().token_store_url is None  # unset: SQLite under data_dir (flywheel.identity.store_url)


def test_production_holds_only_the_secrets_it_is_given() -> None:
    # k8s/ gives each component only the secret keys it reads: the collector its write keys, serving its key.
    collector = Settings(environment="production", write_keys=GOOD)  # type: ignore[arg-type]
    assert collector.write_key_set == {GOOD}
    assert collector.serving_key.get_secret_value() == "" and collector.approval_token.get_secret_value() == ""
    serving = Settings(environment="production", serving_key=GOOD)  # type: ignore[arg-type]
    assert serving.write_key_set == frozenset()  # accepts no event: it was given no write key
    # Development keeps its defaults, so one machine runs with nothing set.
    assert Settings().serving_key.get_secret_value() == "dev-serving-key"


def test_production_refuses_a_placeholder_password_in_a_service_url() -> None:
    url = "redis://gate:REPLACE-gate-password-000000003@flywheel-valkey:6379/0"  # secrets.example's valkey.env
    with pytest.raises(ValidationError, match="REDIS_URL's password is still a placeholder") as err:
        production(redis_url=url)
    assert "REPLACE-gate" not in str(err.value)
    assert production(redis_url=f"redis://gate:{GOOD}@flywheel-valkey:6379/0").redis_url.startswith("redis://")
    Settings(redis_url=url)  # development: whatever the developer runs


def test_a_child_process_gets_the_settings_it_was_handed_unset_ones_included(monkeypatch: pytest.MonkeyPatch) -> None:
    """`flywheel up` hands its settings to each component through the environment: an unset optional setting
    (the token store, a SASL password) stays unset there, never the string "None" (which once made every
    rollout controller's token store an unparseable URL)."""
    from launcher.embedded import settings_env

    for name in list(os.environ):
        if name.startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)
    parent = Settings(token_store_url=None, kafka_sasl_password=None, write_keys=SecretStr("k1,k2"))
    env = settings_env(parent)
    assert "FLYWHEEL_TOKEN_STORE_URL" not in env and "FLYWHEEL_KAFKA_SASL_PASSWORD" not in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = Settings()
    assert child.token_store_url is None and child.kafka_sasl_password is None
    assert child.write_keys.get_secret_value() == "k1,k2"
    assert child.model_dump() == parent.model_dump()
