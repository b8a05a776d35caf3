"""The ways the VM tests reach the testbed's target: RDMA, NVMe/TCP, NVMe/TCP with digests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fabric:
    """One way to reach the testbed's target: the tests that take ``fabric`` run over each."""

    transport: str
    addr: str
    port: int
    nqn: str
    digests: bool = False

    def digest_flags(self) -> list[str]:
        """nvme-cli's --hdr-digest/--data-digest when this fabric uses digests."""
        return ["-g", "-G"] if self.digests else []

    def options(self, **kw):
        """ConnectOptions for the initiator core."""
        from nvmeof_fuse.host.controller import ConnectOptions

        return ConnectOptions(traddr=self.addr, nqn=self.nqn, transport=self.transport,
                              trsvcid=self.port, hdr_digest=self.digests,
                              data_digest=self.digests, **kw)


def make_fabric(testbed, name: str) -> Fabric:
    """``rdma``, ``tcp`` or ``tcp-digests`` to the testbed's target."""
    if name == "rdma":
        return Fabric("rdma", testbed.rdma_addr, testbed.port, testbed.nqn)
    return Fabric("tcp", testbed.tcp_addr, testbed.port, testbed.nqn, digests=name != "tcp")
