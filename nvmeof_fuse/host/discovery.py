"""Read a Discovery controller's log page (what ``nvme discover`` shows)."""

from __future__ import annotations

import dataclasses
import struct

from .. import nvme
from ..errors import TargetProtocolError
from ..nvme import LogPageId
from .controller import ConnectOptions, connect
from .logread import read_whole

MAX_RECORDS = 2048
"""Discovery log entries we read at most (2 MiB); a page claiming more is refused."""


async def discover(options: ConnectOptions) -> nvme.DiscoveryLogPage:
    """Connect to the discovery subsystem at ``options``' address and fetch its log page.

    The header is read first for NUMREC, then the whole page, of one generation
    (:func:`.logread.read_whole`: read in pieces of MDTS, GENCTR is read again after the
    last, and all of it again if it moved); a page that keeps changing is refused in one
    line (LogPageChanging), and so is a NUMREC past :data:`MAX_RECORDS`
    (TargetProtocolError).
    """
    options = dataclasses.replace(options, nqn=nvme.DISCOVERY_NQN, keep_alive_tmo=0,
                                  nr_io_queues=None)

    def length(header: bytes) -> int:
        numrec = struct.unpack_from("<Q", header, 8)[0]
        if numrec > MAX_RECORDS:
            raise TargetProtocolError(
                f"the discovery log page of {options.traddr} claims {numrec} "
                f"records; more than {MAX_RECORDS} are refused")
        return nvme.DiscoveryLogPage.size_for(numrec)

    def genctr(header: bytes) -> int:
        return struct.unpack_from("<Q", header)[0]

    async with connect(options) as controller:
        data = await read_whole(controller, LogPageId.DISCOVERY,
                                header=nvme.DiscoveryLogPage.header_size, length=length,
                                counter=genctr, what=f"the discovery log of {options.traddr}")
    return nvme.DiscoveryLogPage.from_bytes(data)
