"""The testbed's target is real: the kernel initiator sees it over rdma and tcp."""

from __future__ import annotations

import os

from kernel_initiator import connected, nvme, pread_direct, pwrite_direct


def test_discovery_lists_the_subsystem_on_both_transports(testbed):
    for transport, addr in (("rdma", testbed.rdma_addr), ("tcp", testbed.tcp_addr)):
        out = nvme("discover", "-t", transport, "-a", addr, "-s", str(testbed.port))
        assert testbed.nqn in out, out


def test_pattern_written_over_one_transport_reads_back_over_the_other(testbed):
    with connected("rdma", testbed.rdma_addr, testbed.port, testbed.nqn) as rdma, \
         connected("tcp", testbed.tcp_addr, testbed.port, testbed.nqn) as tcp:
        assert sorted(rdma) == sorted(tcp) == [1, 2]
        for nsid, lba in ((1, 512), (2, 4096)):
            with open(f"/sys/block/{os.path.basename(rdma[nsid])}/queue/logical_block_size") as f:
                assert int(f.read()) == lba
            with open(f"/sys/block/{os.path.basename(rdma[nsid])}/size") as f:
                assert int(f.read()) * 512 >= 256 << 20
            for writer, reader in ((rdma, tcp), (tcp, rdma)):
                data = os.urandom(64 << 10)
                offset = 7 * 4096 * nsid + (0 if writer is rdma else 1 << 20)
                pwrite_direct(writer[nsid], offset, data)
                assert pread_direct(reader[nsid], offset, len(data)) == data
