"""Losing the target over NVMe/TCP in the middle of fio verify writes.

The subsystem is unlinked from the TCP port for about 8 s: nvmet deletes our
controller, closes its connections and refuses new ones until the link is back.
The mount reconnects and fio's writes land, so its crc32c verify passes.
(Refused connections and a wrong NQN over TCP: test_fs's bad-mount cases; the target
away for longer than --ctrl-loss-tmo: test_reconnect, parametrized over rdma and tcp.)
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from vm import wait_for

MNT = "/tmp/nvmeof-tcp-faults"
NVMET = "/sys/kernel/config/nvmet"
TCP_PORT = 2  # scripts/testbed-guest: port 1 is rdma, port 2 tcp
OUTAGE = 8  # seconds the port stays unlinked


def written(mnt: str, name: str) -> int:
    with open(f"{mnt}/.nvmeof/stats.json") as f:
        ops = json.load(f)[name]["ops"]
    return sum(op["bytes"] for op in ops.values())


def test_fio_verify_writes_ride_out_an_outage_of_the_tcp_port(testbed, tmp_path):
    log = str(tmp_path / "daemon.log")
    os.makedirs(MNT, exist_ok=True)
    subprocess.run(["nvmeof-fuse", "mount", "-t", "tcp", "-a", testbed.tcp_addr,
                    "-s", str(testbed.port), "-n", testbed.nqn, "--daemon", "--log-file", log,
                    "-k", "2", "-c", "2", "-l", "120", MNT], check=True, timeout=120)
    link = f"{NVMET}/ports/{TCP_PORT}/subsystems/{testbed.nqn}"
    try:
        # rate-limited, so the writes are still going when the port goes away
        fio = subprocess.Popen(
            ["fio", "--name=outage", f"--filename={MNT}/n2", "--rw=randwrite",
             "--bssplit=4k/50:64k/50", "--iodepth=8", "--ioengine=libaio", "--direct=1",
             "--size=24M", "--rate=2m", "--verify=crc32c", "--do_verify=1",
             "--verify_fatal=1", "--output-format=terse"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_for(lambda: written(MNT, "n2") > 1 << 20, 120), "fio wrote nothing"
        os.unlink(link)
        try:
            assert wait_for(lambda: "lost the connection" in open(log).read(), 60), \
                open(log).read()
            time.sleep(OUTAGE)  # the outage itself, not a wait for a condition
        finally:
            os.symlink(f"{NVMET}/subsystems/{testbed.nqn}", link)
        out, err = fio.communicate(timeout=600)
        assert fio.returncode == 0, out[-2000:] + err[-2000:] + open(log).read()
        text = open(log).read()
        assert "reconnected to" in text and "Traceback" not in text, text
        with open(f"{MNT}/.nvmeof/stats.json") as f:
            connection = json.load(f)["connection"]
        assert connection["state"] == "live" and connection["reconnects"] >= 1
    finally:
        if not os.path.lexists(link):
            os.symlink(f"{NVMET}/subsystems/{testbed.nqn}", link)
        subprocess.run(["fusermount3", "-u", MNT], capture_output=True, timeout=120)
        wait_for(lambda: not any(f" {MNT} " in line for line in open("/proc/mounts")), 60)
