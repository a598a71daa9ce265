"""Where the remote cache lives: ``oci://HOST[:PORT]/REPOSITORY`` (HTTPS) or ``oci+http://HOST[:PORT]/REPOSITORY``
(plain HTTP, for a registry on this machine or a trusted network).

Credentials never go in the address (they would end up in recipes, manifests and logs): they come from the
registry's usual places, see :mod:`kiln.cache.credentials`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = {"oci": "https", "oci+https": "https", "oci+http": "http"}
# The OCI distribution spec's repository name grammar.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
CREDENTIALS_HINT = ("log in with `docker login HOST` or `oras login HOST`, or set KILN_REGISTRY_USERNAME and "
                    "KILN_REGISTRY_PASSWORD")


@dataclass(frozen=True)
class CacheRef:
    """A parsed remote-cache address."""

    scheme: str
    """"https" or "http"."""
    host: str
    """host[:port], as credentials are keyed."""
    repository: str

    @property
    def base(self) -> str:
        """The repository's API root: ``{scheme}://{host}/v2/{repository}``."""
        return f"{self.scheme}://{self.host}/v2/{self.repository}"

    def __str__(self) -> str:
        return f"{'oci' if self.scheme == 'https' else 'oci+http'}://{self.host}/{self.repository}"

    def tag_ref(self, tag: str) -> str:
        return f"{self}:{tag}"


def parse_cache_url(text: str) -> CacheRef:
    """Parse a remote-cache address; ValueError with the fix when it is not one. The message never repeats the
    address (it may hold a password someone pasted into it)."""
    if not isinstance(text, str) or "://" not in text:
        raise ValueError("not a registry address: write oci://HOST[:PORT]/REPOSITORY "
                         "(oci+http:// for a plain-HTTP registry)")
    scheme = text.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: write oci://HOST/REPOSITORY (HTTPS) or "
                         "oci+http://HOST/REPOSITORY (plain HTTP)")
    parts = urlsplit(text)
    if "@" in parts.netloc:
        raise ValueError("the address holds credentials: never put them in a recipe or on a command line; "
                         + CREDENTIALS_HINT)
    if parts.query or parts.fragment:
        raise ValueError("the address has a query or fragment: write oci://HOST[:PORT]/REPOSITORY")
    host = parts.netloc
    if not host or not _HOST.match(host):
        raise ValueError("the address has no valid registry host: write oci://HOST[:PORT]/REPOSITORY")
    repository = parts.path.strip("/")
    if ":" in repository or "@" in repository:
        raise ValueError("the address names a tag or digest: give the repository only (kiln tags each entry "
                         "by step and fingerprint)")
    if not _REPOSITORY.match(repository):
        raise ValueError("the repository path must be lower-case letters, digits and separators (. _ __ -), "
                         "components joined by /, e.g. oci://registry.example.com/team/kiln-cache")
    return CacheRef(SCHEMES[scheme], host.lower(), repository)
