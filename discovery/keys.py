"""etcd key layout of the discovery records.

    /tandem/v1/{namespace}/instances/{component}/{instance_id}

`component` is `router`, `prefill` or `decode` and follows the record's `Role`. Namespaces and
instance ids are single path segments: non-empty, no "/", so that a namespace prefix never
matches another namespace ("/tandem/v1/a/" does not match "/tandem/v1/ab/...").
"""

from __future__ import annotations

from typing import NamedTuple

from common.pb.tandem.v1 import discovery_pb2

ROOT = "/tandem/v1"

# Must match the component names of the key layout above and in deploy/ manifests.
COMPONENT_BY_ROLE: dict[int, str] = {
    discovery_pb2.ROLE_ROUTER: "router",
    discovery_pb2.ROLE_PREFILL: "prefill",
    discovery_pb2.ROLE_DECODE: "decode",
}
ROLE_BY_COMPONENT: dict[str, int] = {name: role for role, name in COMPONENT_BY_ROLE.items()}


class ParsedKey(NamedTuple):
    """The parts of an instance key."""

    namespace: str
    component: str
    instance_id: str


def _check_segment(value: str, what: str) -> None:
    if not value or "/" in value:
        raise ValueError(f"{what} must be a non-empty string without '/', got {value!r}")


def component_for_role(role: int) -> str:
    """Map a `discovery_pb2.Role` to its key component.

    Raises:
        ValueError: ROLE_UNSPECIFIED or an unknown value.
    """
    try:
        return COMPONENT_BY_ROLE[role]
    except KeyError:
        raise ValueError(f"instance role {role!r} has no discovery component") from None


def namespace_prefix(namespace: str) -> str:
    """Prefix of every instance key of `namespace` (ends with "/").

    Raises:
        ValueError: empty namespace or one containing "/".
    """
    _check_segment(namespace, "namespace")
    return f"{ROOT}/{namespace}/instances/"


def component_prefix(namespace: str, component: str) -> str:
    """Prefix of the instance keys of one component of `namespace` (ends with "/").

    Raises:
        ValueError: bad namespace or unknown component.
    """
    if component not in ROLE_BY_COMPONENT:
        raise ValueError(
            f"unknown component {component!r}; expected one of {sorted(ROLE_BY_COMPONENT)}"
        )
    return f"{namespace_prefix(namespace)}{component}/"


def instance_key(namespace: str, instance: discovery_pb2.Instance) -> str:
    """The key under which `instance` is registered.

    Raises:
        ValueError: bad namespace, empty/"/"-containing instance_id, or unspecified role.
    """
    _check_segment(instance.instance_id, "instance_id")
    return f"{component_prefix(namespace, component_for_role(instance.role))}{instance.instance_id}"


def parse_key(key: str | bytes) -> ParsedKey:
    """Split an instance key into its parts.

    Raises:
        ValueError: the key does not follow the layout above.
    """
    text = key.decode("utf-8", errors="replace") if isinstance(key, bytes) else key
    parts = text.split("/")
    # ["", "tandem", "v1", namespace, "instances", component, instance_id]
    if (
        len(parts) != 7
        or parts[0] != ""
        or f"/{parts[1]}/{parts[2]}" != ROOT
        or parts[4] != "instances"
        or parts[5] not in ROLE_BY_COMPONENT
        or not parts[3]
        or not parts[6]
    ):
        raise ValueError(f"not a discovery instance key: {text!r}")
    return ParsedKey(namespace=parts[3], component=parts[5], instance_id=parts[6])
