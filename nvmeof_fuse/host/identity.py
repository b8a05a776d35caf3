"""What a namespace and a controller are, as the target says, kept to be compared at every
rescan and after every reconnect: another volume must never be served under the old name.

The kernel reads a namespace's identifiers from Identify Namespace and then the descriptor
list (``nvme_report_ns_ids``), compares them at each scan (``nvme_ns_ids_equal``) and
removes a namespace whose identifiers changed ("identifiers changed for nsid"); it ignores a
namespace that reports another one's identifiers ("duplicate IDs").  We do the same, with
the LBA format compared too, and the size where a namespace reports no identifiers
(:class:`~nvmeof_fuse.nvme.NamespaceIdentity`).  A controller reached again must be of the
subsystem we mounted: subsystem NQN, serial number, model number
(:func:`~nvmeof_fuse.nvme.controller_change`).

No I/O of its own here but the Identify commands it is handed a controller for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from .. import nvme
from ..errors import ControllerChanged
from ..nvme import Cns, NamespaceIdentity, NamespaceIds, NVMeStatusError

log = logging.getLogger(__name__)

NO_IDS = NamespaceIds()
"""A namespace that reports no identifiers: one object for every such namespace (a target
may have 65,536 of them)."""


class IdentifySource(Protocol):
    """What reading identities takes of a controller."""

    options: Any  # its ``nqn`` names the subsystem in messages

    async def identify_raw(self, cns: int, nsid: int = 0) -> bytes: ...


async def namespace_identity(ctrl: IdentifySource, nsid: int,
                             ident: nvme.IdentifyNamespace) -> NamespaceIdentity:
    """The identity of namespace ``nsid`` whose Identify Namespace data is ``ident``: its
    identifiers from Identify Namespace, then from the descriptor list where the controller
    has one (as ``nvme_report_ns_ids``), and its format and size."""
    base = NamespaceIds.from_identify(ident)
    try:
        data = await ctrl.identify_raw(Cns.NS_DESCRIPTOR_LIST, nsid)
    except NVMeStatusError:
        return NamespaceIdentity.of(ident, base)
    try:
        ids = NamespaceIds.from_descriptors(data, base)
    except ValueError as exc:
        log.debug("%s: namespace n%d: %s; using Identify Namespace's identifiers",
                  ctrl.options.nqn, nsid, exc)
        ids = base
    return NamespaceIdentity.of(ident, NO_IDS if ids == NO_IDS else ids)


def replaced_line(nqn: str, nsid: int, old: NamespaceIdentity, new: NamespaceIdentity,
                  change: str) -> str:
    """The one line that says another namespace answers behind ``nsid`` now."""
    return (f"namespace n{nsid} of {nqn} is another namespace now ({change}): it was "
            f"{old.describe()}, it is {new.describe()}; what was open of it fails from now "
            f"on, and it shows as a new file")


class IdentityIndex:
    """Which namespace holds which identifiers: one that reports those of another is a
    duplicate, served by neither name but the first (Linux ignores it: "duplicate IDs")."""

    def __init__(self, namespaces: Iterable[tuple[int, Any]] = ()) -> None:
        self._holder: dict[NamespaceIds, int] = {}
        for nsid, ns in namespaces:
            self.claim(nsid, ns)

    def claim(self, nsid: int, ns: Any) -> None:
        """Index ``ns`` (whose ``identity`` is known); if another namespace holds its
        identifiers, refuse it as unavailable, saying so once."""
        identity = ns.identity
        if identity is None or not identity.ids.reported or ns.conflict:
            return
        holder = self._holder.setdefault(identity.ids, nsid)
        if holder != nsid:
            ns.refuse_as(f"it reports the identifiers of namespace n{holder} "
                         f"({identity.ids.describe()})")


def check_controller(old: nvme.IdentifyController | None, new: nvme.IdentifyController,
                     where: str) -> None:
    """Raise ControllerChanged, in one line naming old and new, unless ``new`` is a
    controller of the subsystem ``old`` was (None: nothing to compare)."""
    if old is None:
        return
    change = nvme.controller_change(old, new)
    if change:
        raise ControllerChanged(f"{where} is not the controller we mounted: its {change}; "
                                "refused")

