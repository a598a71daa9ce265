"""Check Kubernetes manifests offline (:func:`validate_manifests`).

Core kinds are validated against the schemas bundled with ``kubernetes-validate`` in strict mode (unknown
fields are errors); the LeaderWorkerSet, for which it has no schema, by kiln's own checks of the LWS fields
(``kubernetes-sigs/lws`` ``api/leaderworkerset/v1/leaderworkerset_types.go`` @ 060ab4da) plus strict
validation of its pod templates as core ``PodTemplate`` objects; and kiln's policy for every pod (probes,
non-root, no secret values inline).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from kiln.triton.deploy.info import LWS_API_VERSION, LWS_KIND
from kiln.util.dotted import dotted_get

#: Kubernetes versions the manifests are validated against by default: the oldest kiln supports (a
#: version every ``kubernetes-validate>=1.30`` bundles) and the newest the installed package bundles.
MIN_KUBERNETES_VERSION = "1.30"
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Environment variable names that must not carry a value inline (use ``valueFrom.secretKeyRef``).
SECRETISH_ENV = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)


def default_kubernetes_versions() -> tuple[str, ...]:
    """:data:`MIN_KUBERNETES_VERSION` and the newest schema version the installed kubernetes-validate bundles."""
    import kubernetes_validate

    return tuple(dict.fromkeys((MIN_KUBERNETES_VERSION, _major_minor(kubernetes_validate.latest_version()))))


def _major_minor(version: str) -> str:
    return ".".join(version.lstrip("v").split(".")[:2])


def _path(parts: Iterable[Any]) -> str:
    return ".".join(str(p) for p in parts) or "(top)"


def _validate_core(doc: dict[str, Any], where: str, versions: Sequence[str]) -> list[str]:
    """Strict kubernetes-validate of one core object against each version; one problem per failing version."""
    import kubernetes_validate

    problems = []
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}: {_path(e.path)}: {e.message} (Kubernetes {e.version} schema, strict)")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{where}: no schema, cannot validate: {e.message}")
            break
        except kubernetes_validate.utils.VersionNotSupportedError:
            problems.append(
                f"{where}: kubernetes-validate {kubernetes_validate.__version__} has no Kubernetes {version} schemas"
            )
    return problems


# LeaderWorkerSet v1 fields (kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go).
_LWS_TOP = {"apiVersion", "kind", "metadata", "spec"}
_LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
_LWS_TEMPLATE = {
    "leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy",
    "volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy",
}
_LWS_ENUMS = {
    "spec.startupPolicy": {"LeaderCreated", "LeaderReady"},
    "spec.leaderWorkerTemplate.restartPolicy": {
        "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None", "Default",
    },
    "spec.rolloutStrategy.type": {"RollingUpdate"},
    "spec.networkConfig.subdomainPolicy": {"Shared", "UniquePerReplica"},
    "spec.leaderWorkerTemplate.subGroupPolicy.subGroupPolicyType": {"LeaderWorker", "LeaderExcluded"},
    "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy.whenDeleted": {"Retain", "Delete"},
    "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy.whenScaled": {"Retain", "Delete"},
}
_LWS_REQUIRED = {"spec.rolloutStrategy": "type", "spec.networkConfig": "subdomainPolicy"}
_LWS_NESTED = {
    "spec.rolloutStrategy": {"type", "rollingUpdateConfiguration"},
    "spec.rolloutStrategy.rollingUpdateConfiguration": {"partition", "maxUnavailable", "maxSurge"},
    "spec.networkConfig": {"subdomainPolicy"},
    "spec.leaderWorkerTemplate.subGroupPolicy": {"subGroupPolicyType", "subGroupSize"},
    "spec.leaderWorkerTemplate.persistentVolumeClaimRetentionPolicy": {"whenDeleted", "whenScaled"},
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_lws(doc: dict[str, Any], where: str, versions: Sequence[str]) -> list[str]:
    """kiln's checks of a LeaderWorkerSet (kubernetes-validate has no schema for this CRD)."""
    problems: list[str] = []

    def unknown(obj: Any, allowed: set[str], at: str) -> None:
        if not isinstance(obj, dict):
            problems.append(f"{where}: {at}: must be a mapping")
            return
        for key in sorted(set(obj) - allowed):
            problems.append(
                f"{where}: {at}.{key}: unknown field (LeaderWorkerSet v1 allows {', '.join(sorted(allowed))})"
            )

    unknown(doc, _LWS_TOP, "(top)")
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems + [f"{where}: spec: missing"]
    unknown(spec, _LWS_SPEC, "spec")
    replicas = spec.get("replicas", 1)
    if not _is_int(replicas) or not 0 <= replicas <= 1_000_000:
        problems.append(f"{where}: spec.replicas: {replicas!r} is not an integer from 0 to 1000000")
    lwt = spec.get("leaderWorkerTemplate")
    if not isinstance(lwt, dict):
        return problems + [f"{where}: spec.leaderWorkerTemplate: missing"]
    unknown(lwt, _LWS_TEMPLATE, "spec.leaderWorkerTemplate")
    size = lwt.get("size", 1)
    if not _is_int(size) or size < 1:
        problems.append(f"{where}: spec.leaderWorkerTemplate.size: {size!r} is not an integer ≥ 1")
    for dotted, allowed in _LWS_NESTED.items():
        value = dotted_get(doc, dotted)
        if value is not None:
            unknown(value, allowed, dotted)
    for dotted, key in _LWS_REQUIRED.items():
        value = dotted_get(doc, dotted)
        if isinstance(value, dict) and key not in value:
            problems.append(f"{where}: {dotted}.{key}: missing (required)")
    for dotted, values in _LWS_ENUMS.items():
        value = dotted_get(doc, dotted)
        if value is not None and value not in values:
            problems.append(f"{where}: {dotted}: {value!r} is not one of {', '.join(sorted(values))}")
    sub_size = dotted_get(doc, "spec.leaderWorkerTemplate.subGroupPolicy.subGroupSize")
    if sub_size is not None and (not _is_int(sub_size) or sub_size < 1 or (_is_int(size) and sub_size > size)):
        problems.append(f"{where}: spec.leaderWorkerTemplate.subGroupPolicy.subGroupSize: {sub_size!r} must be 1..size")
    if "workerTemplate" not in lwt:
        problems.append(f"{where}: spec.leaderWorkerTemplate.workerTemplate: missing (required)")

    # The pod templates are core PodTemplateSpecs: validate each strictly, wrapped in a core PodTemplate
    # that carries the LWS's own metadata (so ObjectMeta is checked too).
    for role in ("leaderTemplate", "workerTemplate"):
        template = lwt.get(role)
        if template is None:
            continue
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": doc.get("metadata"), "template": template}
        for problem in _validate_core(wrapped, f"{where} {role}", versions):
            problems.append(problem.replace(": template.", ": spec.leaderWorkerTemplate." + role + ".", 1))
    for i, claim in enumerate(lwt.get("volumeClaimTemplates") or []):
        wrapped = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **claim} if isinstance(claim, dict) else claim
        problems += _validate_core(wrapped, f"{where} volumeClaimTemplates[{i}]", versions)
    return problems


def _pod_templates(doc: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    """``(label, pod template)`` of every pod an object creates."""
    kind = doc.get("kind")
    if kind == LWS_KIND:
        lwt = dotted_get(doc, "spec.leaderWorkerTemplate") or {}
        return [(f"{where} {role}", lwt[role]) for role in ("leaderTemplate", "workerTemplate") if role in lwt]
    if kind in {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}:
        return [(f"{where} template", dotted_get(doc, "spec.template"))]
    if kind == "Pod":
        return [(where, doc)]
    return []


def _check_pod(template: Any, where: str, *, probes: bool = True) -> list[str]:
    """kiln's policy for a pod: probes (for pods that serve; a Job's pods run to completion), non-root, no
    privilege escalation, no secret values inline."""
    spec = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(spec, dict):
        return [f"{where}: spec: missing"]
    problems = []
    pod_security = spec.get("securityContext") or {}
    if pod_security.get("runAsNonRoot") is not True:
        problems.append(f"{where}: spec.securityContext.runAsNonRoot: must be true")
    if pod_security.get("runAsUser") == 0:
        problems.append(f"{where}: spec.securityContext.runAsUser: must not be 0 (root)")
    init = [c for c in spec.get("initContainers") or [] if isinstance(c, dict)]
    for c in [*(spec.get("containers") or []), *init]:
        if not isinstance(c, dict):
            continue
        at = f"{where}: {'init container' if c in init else 'container'} {c.get('name', '?')!r}"
        resources = c.get("resources") or {}
        for kind in ("requests", "limits") if probes else ():  # serving pods (a sweep Job sizes its own)
            missing = [r for r in ("cpu", "memory") if r not in (resources.get(kind) or {})]
            if missing:
                problems.append(f"{at}: resources.{kind}: no {' or '.join(missing)} (a pod without them is the "
                                "first evicted under node pressure)")
        for probe in ("readinessProbe", "livenessProbe") if probes and c not in init else ():
            if probe not in c:
                problems.append(f"{at}: no {probe}")
        security = c.get("securityContext") or {}
        if security.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{at}: securityContext.allowPrivilegeEscalation: must be false")
        if "ALL" not in ((security.get("capabilities") or {}).get("drop") or []):
            problems.append(f"{at}: securityContext.capabilities.drop: must contain ALL")
        if security.get("privileged") is True or security.get("runAsUser") == 0:
            problems.append(f"{at}: securityContext: must not run privileged or as root")
        for var in c.get("env") or []:
            if isinstance(var, dict) and "value" in var and SECRETISH_ENV.search(str(var.get("name", ""))):
                problems.append(
                    f"{at}: env {var['name']}: a secret value inline; use valueFrom.secretKeyRef"
                )
        resources = c.get("resources") or {}
        limit = (resources.get("limits") or {}).get("nvidia.com/gpu")
        request = (resources.get("requests") or {}).get("nvidia.com/gpu")
        if request is not None and str(request) != str(limit):
            problems.append(f"{at}: resources: nvidia.com/gpu request {request} must equal its limit {limit}")
    mounts = {m.get("mountPath"): m.get("name") for c in spec.get("containers") or [] if isinstance(c, dict)
              for m in c.get("volumeMounts") or [] if isinstance(m, dict)}
    shm = mounts.get("/dev/shm")
    if shm is not None:
        volume = next((v for v in spec.get("volumes") or [] if isinstance(v, dict) and v.get("name") == shm), None)
        if not volume or (volume.get("emptyDir") or {}).get("medium") != "Memory":
            problems.append(f"{where}: /dev/shm: must be an emptyDir with medium: Memory")
    return problems


def _check_names(doc: dict[str, Any], where: str) -> list[str]:
    name = dotted_get(doc, "metadata.name")
    if not isinstance(name, str) or not name:
        return [f"{where}: metadata.name: missing"]
    if len(name) > 63 or not _DNS1123_LABEL.match(name):
        return [f"{where}: metadata.name: {name!r} is not a DNS-1123 label (a-z, 0-9, '-', at most 63 characters)"]
    if doc.get("kind") == "Service" and not name[0].isalpha():
        return [f"{where}: metadata.name: a Service name must start with a letter (DNS-1035)"]
    return []


def validate_manifests(paths: Sequence[Path], *, kubernetes_versions: Sequence[str] | None = None) -> list[str]:
    """Problems in Kubernetes manifest files; ``[]`` when every object is valid.

    Core kinds are validated by kubernetes-validate in strict mode (unknown fields are errors) against
    ``kubernetes_versions`` (default :func:`default_kubernetes_versions`). A LeaderWorkerSet, for which it has
    no schema, gets kiln's field checks and strict validation of its pod templates as core ``PodTemplate``
    objects. Every object's name must be a DNS-1123 label, and every pod must follow kiln's policy (readiness
    and liveness probes except in a Job's pods, which run to completion; non-root, no privilege escalation, all capabilities dropped, no secret values inline,
    ``/dev/shm`` in memory). Each problem names the file, the object and the field.
    """
    versions = tuple(kubernetes_versions) if kubernetes_versions else default_kubernetes_versions()
    problems: list[str] = []
    for path in paths:
        path = Path(path)
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
        except (OSError, yaml.YAMLError) as e:
            problems.append(f"{path}: cannot read as YAML: {e}")
            continue
        if not docs:
            problems.append(f"{path}: no Kubernetes object in the file")
        for doc in docs:
            if not isinstance(doc, dict) or not doc.get("apiVersion") or not doc.get("kind"):
                problems.append(f"{path}: an object without apiVersion and kind")
                continue
            where = f"{path.name}: {doc['kind']}/{dotted_get(doc, 'metadata.name')}"
            if doc["kind"] == LWS_KIND:
                if doc["apiVersion"] != LWS_API_VERSION:
                    problems.append(f"{where}: apiVersion {doc['apiVersion']!r}; kiln writes {LWS_API_VERSION}")
                problems += _check_lws(doc, where, versions)
            else:
                problems += _validate_core(doc, where, versions)
            problems += _check_names(doc, where)
            for pod_where, template in _pod_templates(doc, where):
                problems += _check_pod(template, pod_where, probes=doc["kind"] != "Job")
    return problems
