"""API keys and tenants at the router's front (`--api-keys FILE`, docs/security.md).

The key file (TOML, or JSON for a name ending in .json) lists keys, each of one tenant:

    [[keys]]
    key = "tk-0b9e...";  tenant = "acme"
    admin = false            # optional: may call ExplainRoute, ClusterStatus and HTTP /metrics
    cache_group = ""         # optional: tenants naming one group share a prefix cache

A client sends its key as a bearer token: gRPC metadata `authorization: Bearer <key>`, HTTP
header `Authorization: Bearer <key>`. The tenant's cache salt (`Tenant.cache_salt`) enters the
seed of the prompt's block hashes on the router and on the workers, so one tenant's cached
prefix can be neither hit nor detected by another. Without --api-keys the front is open and
the salt is empty (one shared cache), as before.

Keys are kept as SHA-256 digests only, and looked up by digest (no secret-dependent string
comparison). The file is read at start-up and again on SIGHUP (`KeyRing.reload`).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import grpc

from common.tls import guarded  # the same handler wrapping as the certificate role check

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16  # a shorter key is guessable; refused when the file is read
ADMIN_METHODS = frozenset({"ExplainRoute", "ClusterStatus"})  # of tandem.v1.FrontendService
SERVICE = "tandem.v1.FrontendService"
_FIELDS = {"key", "tenant", "admin", "cache_group"}


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to.

    name: the tenant (non-empty). admin: may call the admin-only methods. cache_group: tenants
    with the same non-empty group share a prefix cache.
    """

    name: str
    admin: bool = False
    cache_group: str = ""

    @property
    def cache_salt(self) -> str:
        """The salt of this tenant's block hashes (DecodeRequest.cache_salt)."""
        return f"group:{self.cache_group}" if self.cache_group else f"tenant:{self.name}"


current_tenant: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("tandem_tenant", default=None)


def cache_salt() -> str:
    """The calling request's cache salt: its tenant's, or "" without --api-keys."""
    tenant = current_tenant.get()
    return tenant.cache_salt if tenant is not None else ""


class KeyRefused(Exception):
    """A call without a valid key (`unauthenticated`) or one its key may not make."""

    def __init__(self, unauthenticated: bool, message: str) -> None:
        super().__init__(message)
        self.unauthenticated = unauthenticated

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED if self.unauthenticated else grpc.StatusCode.PERMISSION_DENIED

    @property
    def http_status(self) -> int:
        return 401 if self.unauthenticated else 403


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key_file(path: str) -> dict[bytes, Tenant]:
    """key digest -> Tenant, from a TOML or JSON key file.

    Raises:
        ValueError: naming --api-keys, the file and the entry: unreadable, not TOML/JSON, no
            keys, an unknown field, a missing or empty key or tenant, a key shorter than
            MIN_KEY_CHARS, a key listed twice.
    """
    return {_digest(key): tenant for key, tenant in _read(path)}


def admin_key(path: str) -> str:
    """The first admin key of a key file (`tandem up` checks its router with it).

    Raises:
        ValueError: see parse_key_file; or the file has no admin key.
    """
    key = next((k for k, t in _read(path) if t.admin), None)
    if key is None:
        raise ValueError(f"--api-keys {path}: no admin key (set admin = true on one)")
    return key


def _read(path: str) -> list[tuple[str, Tenant]]:
    """(key, tenant) of every entry, checked as parse_key_file says."""
    where = f"--api-keys {path}"
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    try:
        doc: Any = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"{where}: not valid {'JSON' if path.endswith('.json') else 'TOML'}: {exc}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{where}: no keys (expected a list `keys` of {{key, tenant[, admin, cache_group]}})")
    keys: list[tuple[str, Tenant]] = []
    seen: set[str] = set()
    for i, e in enumerate(entries):
        at = f"{where}: keys[{i}]"
        if not isinstance(e, dict):
            raise ValueError(f"{at}: not a table")
        unknown = set(e) - _FIELDS
        if unknown:
            raise ValueError(f"{at}: unknown field {', '.join(sorted(unknown))} (known: {', '.join(sorted(_FIELDS))})")
        key, tenant = e.get("key"), e.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{at}: tenant must be a non-empty string")
        if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
            raise ValueError(f"{at}: key must be a string of at least {MIN_KEY_CHARS} characters")
        admin, group = e.get("admin", False), e.get("cache_group", "")
        if not isinstance(admin, bool):
            raise ValueError(f"{at}: admin must be true or false")
        if not isinstance(group, str):
            raise ValueError(f"{at}: cache_group must be a string")
        if key in seen:
            raise ValueError(f"{at}: this key is listed twice")
        seen.add(key)
        keys.append((key, Tenant(tenant, admin, group)))
    return keys


class KeyRing:
    """The keys of one key file; `authenticate` maps an authorization value to its tenant.

    Raises (on construction):
        ValueError: see parse_key_file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._keys = parse_key_file(path)

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self) -> bool:
        """Read the file again (SIGHUP); on an error keep the old keys and log it. True if replaced."""
        try:
            self._keys = parse_key_file(self.path)
        except ValueError as exc:
            log.error("keeping the %d API keys loaded before: %s", len(self._keys), exc)
            return False
        log.info("reloaded %d API keys from %s", len(self._keys), self.path)
        return True

    def authenticate(self, authorization: str | None, admin_only: bool = False) -> Tenant:
        """The tenant of `authorization` ("Bearer <key>").

        Raises:
            KeyRefused: unauthenticated when the value is missing, not a bearer token or an
                unknown key; not when the key is valid but admin_only and the key is no admin's.
        """
        if not authorization:
            raise KeyRefused(True, "authorization: missing API key (send `authorization: Bearer <key>`)")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise KeyRefused(True, "authorization: expected `Bearer <key>`")
        tenant = self._keys.get(_digest(token.strip()))
        if tenant is None:
            raise KeyRefused(True, "authorization: invalid API key")
        if admin_only and not tenant.admin:
            raise KeyRefused(False, f"tenant {tenant.name!r}: this call needs an admin API key")
        return tenant


def one_authorization(values: Sequence[str]) -> str | None:
    """A call's one authorization value (gRPC metadata and HTTP headers may repeat it), None
    without one.

    Raises:
        KeyRefused: unauthenticated when it is given more than once: which one would count must
            not depend on the API (gRPC's metadata dict kept the last, HTTP the first).
    """
    if len(values) > 1:
        raise KeyRefused(True, f"authorization: given {len(values)} times; send one API key")
    return values[0] if values else None


class ApiKeyCheck(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED / PERMISSION_DENIED for FrontendService calls without a valid key (health
    and reflection stay open, for probes); sets `current_tenant` for the call's task."""

    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").partition("/")
        if handler is None or service != SERVICE:
            return handler
        keys, admin_only = self.keys, method in ADMIN_METHODS

        async def check(context: grpc.aio.ServicerContext) -> None:
            values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
            try:
                current_tenant.set(keys.authenticate(one_authorization(values), admin_only))
            except KeyRefused as exc:
                await context.abort(exc.grpc_code, str(exc))
        return guarded(handler, check)
