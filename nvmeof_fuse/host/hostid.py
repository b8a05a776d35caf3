"""Host identity as nvme-cli does it: /etc/nvme/hostnqn and /etc/nvme/hostid, else generated."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument

NQN_UUID_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"


@dataclass(frozen=True, slots=True)
class HostIdentity:
    hostnqn: str
    hostid: uuid.UUID


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _stable_uuid() -> uuid.UUID:
    """The machine's DMI product UUID when readable, else one derived from /etc/machine-id."""
    for source in ("/sys/class/dmi/id/product_uuid", "/etc/machine-id"):
        text = _read(Path(source))
        if text:
            try:
                return uuid.UUID(text)
            except ValueError:
                return uuid.uuid5(uuid.NAMESPACE_OID, text)
    return uuid.uuid4()


def host_identity(hostnqn: str | None = None, hostid: str | None = None,
                  etc: Path = Path("/etc/nvme")) -> HostIdentity:
    """Options win; then /etc/nvme/hostnqn and /etc/nvme/hostid; then a stable generated pair."""
    hostnqn = hostnqn or _read(etc / "hostnqn")
    source = "--hostid" if hostid else str(etc / "hostid")
    hostid = hostid or _read(etc / "hostid")
    if hostid is not None:
        try:
            host_uuid = uuid.UUID(hostid)
        except ValueError:
            raise InvalidArgument(f"{source}: {hostid!r} is not a UUID") from None
    elif hostnqn is not None and hostnqn.startswith(NQN_UUID_PREFIX):
        try:
            host_uuid = uuid.UUID(hostnqn.removeprefix(NQN_UUID_PREFIX))
        except ValueError:
            host_uuid = _stable_uuid()
    else:
        host_uuid = _stable_uuid()
    return HostIdentity(hostnqn or f"{NQN_UUID_PREFIX}{host_uuid}", host_uuid)
