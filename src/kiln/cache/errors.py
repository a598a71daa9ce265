"""What can go wrong talking to the remote cache. Every message names the registry and says what to do; none
ever holds a credential."""

from __future__ import annotations

from kiln.util.errors import KilnError


class CacheError(KilnError):
    """The remote cache could not do what was asked (exit code 1 where it is fatal: ``--cache-required``)."""

    #: True when the rest of the run should not try the registry again (it is down, or refuses us).
    disables = False


class UnreachableError(CacheError):
    """The registry did not answer (connection refused, DNS, timeout, TLS)."""

    disables = True


class AuthError(CacheError):
    """The registry refused the credentials, or there were none where it needs some."""

    disables = True


class DigestMismatch(CacheError):
    """A blob's bytes did not hash to the digest its manifest names: corrupt in the registry or in transit."""

    def __init__(self, message: str, digest: str):
        super().__init__(message)
        self.digest = digest


class BadArtifact(CacheError):
    """A manifest or config that is not a complete kiln step output for what was asked (wrong fingerprint,
    files missing, unsafe paths)."""


class RegistryError(CacheError):
    """Any other refusal from the registry (an HTTP status with its OCI error codes)."""
