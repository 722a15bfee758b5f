"""Schemas: built-in kinds strictly (`kubernetes-validate`), custom resources against their CRDs' openAPIV3Schema
made strict (unknown fields refused); a kind with neither schema fails."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.k8s_checks.manifests import KUBERNETES_VERSION, Manifests, Problem, Resource, where


@cache
def crd_schemas(directory: Path) -> dict[tuple[str, str], Resource]:
    """(apiVersion, kind) -> JSON Schema made strict: objects refuse fields their schema does not name."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for version in doc["spec"]["versions"]:
                if version.get("served", True):
                    schema = _strict(version["schema"]["openAPIV3Schema"])
                    out[(f"{group}/{version['name']}", kind)] = schema
    return out


def _strict(schema: Any) -> Any:
    """openAPIV3Schema as JSON Schema, with additionalProperties false where Kubernetes prunes unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    if (
        out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


CUSTOM_GROUPS = {"kafka.strimzi.io", "monitoring.coreos.com", "kubeflow.org"}


def check_schemas(m: Manifests, crds: Path | None) -> list[Problem]:
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    problems = []
    custom = crd_schemas(crds) if crds else {}
    for obj in m.docs:
        key = (obj.get("apiVersion", ""), obj.get("kind", ""))
        if key in custom:
            for err in jsonschema.Draft7Validator(custom[key]).iter_errors(obj):
                path = ".".join(str(p) for p in err.absolute_path)
                problems.append(Problem("schemas", where(obj), f"{path}: {err.message}"))
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except SchemaNotFoundError:
            if crds is None and key[0].split("/")[0] in CUSTOM_GROUPS:
                continue  # its CRD schema is not here: the caller says the CRD check skipped
            problems.append(Problem("schemas", where(obj), f"no schema for {key[0]} {key[1]}"))
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(Problem("schemas", where(obj), f"{path}: {exc.message}"))
    return problems
