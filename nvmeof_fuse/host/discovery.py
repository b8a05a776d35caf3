"""Read a Discovery controller's log page (what ``nvme discover`` shows)."""

from __future__ import annotations

import dataclasses

from .. import nvme
from ..errors import TargetProtocolError
from ..nvme import LogPageId
from .controller import ConnectOptions, connect

MAX_GENCTR_RETRIES = 3
MAX_RECORDS = 2048
"""Discovery log entries we read at most (2 MiB); a page claiming more is refused."""


async def discover(options: ConnectOptions) -> nvme.DiscoveryLogPage:
    """Connect to the discovery subsystem at ``options``' address and fetch its log page.

    The header is read first for NUMREC, then the whole page (in pieces of MDTS); if the
    generation counter moved in between, the page is read again.  A NUMREC past
    :data:`MAX_RECORDS` is refused in one line (TargetProtocolError).
    """
    options = dataclasses.replace(options, nqn=nvme.DISCOVERY_NQN, keep_alive_tmo=0,
                                  nr_io_queues=None)
    async with connect(options) as controller:
        page = None
        for _ in range(MAX_GENCTR_RETRIES):
            header = nvme.DiscoveryLogPage.from_bytes(await controller.get_log_page(
                LogPageId.DISCOVERY, nvme.DiscoveryLogPage.header_size))
            if header.numrec > MAX_RECORDS:
                raise TargetProtocolError(
                    f"the discovery log page of {options.traddr} claims {header.numrec} "
                    f"records; more than {MAX_RECORDS} are refused")
            page = nvme.DiscoveryLogPage.from_bytes(await controller.get_log_page(
                LogPageId.DISCOVERY, nvme.DiscoveryLogPage.size_for(header.numrec)))
            if page.genctr == header.genctr and page.complete:
                break
        assert page is not None
        return page
