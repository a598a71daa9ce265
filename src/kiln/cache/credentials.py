"""Registry credentials from the places registries' own tools keep them — never from a recipe.

Looked up in this order, the first that has an entry for the registry's host winning:

1. ``KILN_REGISTRY_USERNAME`` and ``KILN_REGISTRY_PASSWORD`` (CI secrets);
2. the Docker config that ``docker login`` and ``oras login`` write: ``$DOCKER_CONFIG/config.json``, else
   ``~/.docker/config.json`` — an inline ``auth`` or ``identitytoken``, else the host's ``credHelpers`` entry or
   the ``credsStore``, asked through ``docker-credential-<name> get``;
3. the containers auth file that ``podman login``, ``skopeo`` and ``buildah`` write: ``$REGISTRY_AUTH_FILE``,
   else ``$XDG_RUNTIME_DIR/containers/auth.json``, else ``~/.config/containers/auth.json``.

A :class:`Credentials` never shows its secret (repr, str, messages name only where it came from).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

ENV_USERNAME = "KILN_REGISTRY_USERNAME"
ENV_PASSWORD = "KILN_REGISTRY_PASSWORD"
TOKEN_USERNAME = "<token>"  # what credential helpers and docker config use for an identity (refresh) token


@dataclass(frozen=True)
class Credentials:
    username: str
    secret: str = field(repr=False)
    source: str = ""
    """Where they came from, for messages: an environment variable pair, a file, a credential helper."""
    identity_token: bool = False
    """The secret is an OAuth2 refresh token (``identitytoken``), exchanged at the registry's token service."""

    def __str__(self) -> str:
        return f"credentials for {self.username!r} from {self.source}"


def _host_key(key: str) -> str:
    """A config's auths key as a bare host[:port]: "https://index.docker.io/v1/" → "index.docker.io"."""
    key = key.strip().lower()
    for prefix in ("https://", "http://"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key.split("/", 1)[0]


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _from_auths(auths: object, host: str, source: str) -> Optional[Credentials]:
    if not isinstance(auths, dict):
        return None
    for key, entry in auths.items():
        if _host_key(str(key)) != host or not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            return Credentials(TOKEN_USERNAME, str(entry["identitytoken"]), source, identity_token=True)
        if entry.get("auth"):
            try:
                user, _, secret = base64.b64decode(str(entry["auth"])).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                continue
            return Credentials(user, secret, source)
        if entry.get("username") and entry.get("password"):
            return Credentials(str(entry["username"]), str(entry["password"]), source)
    return None


def _from_helper(helper: str, host: str, env: Mapping[str, str]) -> Optional[Credentials]:
    program = f"docker-credential-{helper}"
    for server in (host, f"https://{host}"):
        try:
            proc = subprocess.run([program, "get"], input=server, capture_output=True, text=True, timeout=30,
                                  env=dict(env))
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:
            continue
        try:
            data = json.loads(proc.stdout)
        except ValueError:
            return None
        user, secret = str(data.get("Username", "")), str(data.get("Secret", ""))
        if secret:
            return Credentials(user, secret, program, identity_token=user == TOKEN_USERNAME)
    return None


def docker_config_path(env: Mapping[str, str]) -> Path:
    base = env.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path(env.get("HOME", str(Path.home()))) / ".docker" / "config.json"


def containers_auth_paths(env: Mapping[str, str]) -> list[Path]:
    if env.get("REGISTRY_AUTH_FILE"):
        return [Path(env["REGISTRY_AUTH_FILE"])]
    paths = []
    if env.get("XDG_RUNTIME_DIR"):
        paths.append(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    paths.append(Path(env.get("HOME", str(Path.home()))) / ".config" / "containers" / "auth.json")
    return paths


def find_credentials(host: str, env: Optional[Mapping[str, str]] = None) -> Optional[Credentials]:
    """Credentials for ``host`` (host[:port]) from the usual places, or None (anonymous)."""
    env = os.environ if env is None else env
    host = _host_key(host)
    user, secret = env.get(ENV_USERNAME), env.get(ENV_PASSWORD)
    if user and secret:
        return Credentials(user, secret, f"{ENV_USERNAME}/{ENV_PASSWORD}")
    path = docker_config_path(env)
    config = _read_json(path)
    if config is not None:
        found = _from_auths(config.get("auths"), host, str(path))
        if found is not None:
            return found
        helpers = config.get("credHelpers") if isinstance(config.get("credHelpers"), dict) else {}
        helper = next((str(v) for k, v in helpers.items() if _host_key(str(k)) == host), None)
        helper = helper or (str(config["credsStore"]) if config.get("credsStore") else None)
        if helper:
            found = _from_helper(helper, host, env)
            if found is not None:
                return found
    for path in containers_auth_paths(env):
        config = _read_json(path)
        if config is not None:
            found = _from_auths(config.get("auths"), host, str(path))
            if found is not None:
                return found
    return None
