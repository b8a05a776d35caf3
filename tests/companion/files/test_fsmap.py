"""The chain file -> filesystem -> loop device -> namespace file, over a fake sysfs tree
(companion/fsmap.py); the ioctl itself runs in the VM (tests/testbed/test_files.py)."""

from __future__ import annotations

import os

import pytest

from nvmeof_fuse.companion.files import fiemap as fm
from nvmeof_fuse.companion.files import fsmap
from nvmeof_fuse.companion.protocol import CompanionError


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    """A sysfs with loop0 over MNT/n2 (offset 4096) and its partition loop0p1 at sector
    2048, loop1 over a plain image, and a mount table the test fills in."""
    root = tmp_path / "sys"
    mnt = tmp_path / "mnt"
    (mnt / ".nvmeof").mkdir(parents=True)
    (mnt / ".nvmeof" / "companion.json").write_text("{}")
    (mnt / "n2").write_bytes(b"")
    (tmp_path / "plain.img").write_bytes(b"")
    devices = root / "devices" / "virtual" / "block"
    for loop, backing in (("loop0", mnt / "n2"), ("loop1", tmp_path / "plain.img")):
        d = devices / loop
        write(d / "loop" / "backing_file", str(backing))
        write(d / "loop" / "offset", "4096" if loop == "loop0" else "0")
        write(d / "loop" / "sizelimit", "0")
        write(d / "loop" / "dio", "1")
        write(d / "queue" / "logical_block_size", "512")
        write(d / "size", "524288")
    part = devices / "loop0" / "loop0p1"
    write(part / "partition", "1")
    write(part / "start", "2048")
    write(part / "size", "100000")
    for name, target, devno in (("loop0", devices / "loop0", "7:0"),
                                ("loop1", devices / "loop1", "7:1"),
                                ("loop0p1", part, "259:0"),
                                ("sda", devices / "sda", "8:0")):
        target.mkdir(parents=True, exist_ok=True)
        (root / "class" / "block").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
        (root / "class" / "block" / name).symlink_to(target)
        (root / "dev" / "block" / devno).symlink_to(target)
        if name in ("loop0", "loop1"):
            (root / "block").mkdir(exist_ok=True)
            (root / "block" / name).symlink_to(target)
    monkeypatch.setattr(fsmap, "SYSFS", str(root))
    mounts: dict[int, tuple[str, str, str]] = {}
    monkeypatch.setattr(fsmap, "mount_of", lambda dev: mounts.get(dev, ("", "", "")))
    return tmp_path, mnt, mounts


def on(st: os.stat_result, major: int, minor: int) -> os.stat_result:
    fields = list(st)
    fields[2] = os.makedev(major, minor)  # st_dev
    return os.stat_result(fields)


def test_a_file_on_a_loop_device_over_a_namespace(sysfs):
    tmp, mnt, mounts = sysfs
    f = tmp / "f"
    f.write_bytes(b"x")
    mounts[os.makedev(7, 0)] = ("ext4", "/dev/loop0", "/data")
    chain = fsmap.resolve(str(f), on(os.stat(f), 7, 0))
    assert (chain.fstype, chain.device, chain.loop) == ("ext4", "loop0", "loop0")
    assert chain.namespace == str(mnt / "n2")
    assert (chain.offset, chain.limit, chain.sector, chain.direct_io) == (4096, 0, 512, True)


def test_a_partition_adds_its_start_and_bounds_the_device(sysfs):
    tmp, mnt, mounts = sysfs
    f = tmp / "f"
    f.write_bytes(b"x")
    mounts[os.makedev(259, 0)] = ("xfs", "/dev/loop0p1", "/data")
    chain = fsmap.resolve(str(f), on(os.stat(f), 259, 0))
    assert (chain.device, chain.loop, chain.namespace) == ("loop0p1", "loop0", str(mnt / "n2"))
    assert chain.offset == 4096 + 2048 * 512 and chain.limit == 100000 * 512


def test_tmpfs_and_other_devices_are_refused_by_name(sysfs):
    tmp, _mnt, mounts = sysfs
    f = tmp / "f"
    f.write_bytes(b"x")
    mounts[os.makedev(0, 40)] = ("tmpfs", "tmpfs", "/tmp")
    with pytest.raises(CompanionError, match=r"is on tmpfs \(/tmp\), not on a filesystem on a "
                                             "namespace"):
        fsmap.resolve(str(f), on(os.stat(f), 0, 40))
    mounts[os.makedev(8, 0)] = ("ext4", "/dev/sda", "/")
    with pytest.raises(CompanionError, match="is on ext4 on /dev/sda, not on a loop device"):
        fsmap.resolve(str(f), on(os.stat(f), 8, 0))
    mounts[os.makedev(7, 1)] = ("ext4", "/dev/loop1", "/img")
    with pytest.raises(CompanionError, match="a loop device over .*plain.img, not a namespace"):
        fsmap.resolve(str(f), on(os.stat(f), 7, 1))
    with pytest.raises(CompanionError, match="is not a regular file"):
        fsmap.resolve(str(tmp))
    with pytest.raises(CompanionError, match="which is not a block device"):
        fsmap.resolve(str(f), on(os.stat(f), 0, 99))


def test_mountinfo_is_read_with_its_escapes(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /proc rw - proc proc rw\n"
        "40 22 7:0 / /mnt/my\\040data rw,relatime shared:1 - ext4 /dev/loop0 rw\n")
    assert fsmap.mount_of(os.makedev(7, 0), str(info)) == ("ext4", "/dev/loop0", "/mnt/my data")
    assert fsmap.mount_of(os.makedev(7, 9), str(info)) == ("", "", "")


@pytest.mark.parametrize(("options", "file_flags", "journals"), [
    ("rw,data=ordered", 0, False),
    ("rw,data=journal", 0, True),
    ("rw,data=ordered", fsmap.FS_JOURNAL_DATA_FL, True),  # chattr +j
])
def test_journalled_data_is_seen_on_the_mount_or_the_file(tmp_path, monkeypatch, options,
                                                          file_flags, journals):
    info = tmp_path / "mountinfo"
    info.write_text(f"40 22 7:0 / /data rw,relatime shared:1 - ext4 /dev/loop0 {options}\n")

    def ioctl(fd, request, buf):
        assert request == fsmap.FS_IOC_GETFLAGS
        buf[:4] = file_flags.to_bytes(4, "little")
        return 0

    monkeypatch.setattr(fsmap.fcntl, "ioctl", ioctl)
    assert fsmap.journals_data(3, os.makedev(7, 0), str(info)) is journals


def test_is_namespace_file(sysfs):
    tmp, mnt, _ = sysfs
    assert fsmap.is_namespace_file(str(mnt / "n2"))
    assert not fsmap.is_namespace_file(str(tmp / "plain.img"))
    (tmp / "n1").write_bytes(b"")
    assert not fsmap.is_namespace_file(str(tmp / "n1"))


def fake_ioctl(monkeypatch, extents, replies):
    """An FS_IOC_FIEMAP over ``extents`` that answers like the kernel, or replays
    ``replies`` (lists of extents) when given; the requests' starts are returned."""
    asked = []

    def ioctl(fd, request, buf):
        assert request == fm.FS_IOC_FIEMAP
        start, length, flags, _, count, _ = fm.HEADER.unpack_from(buf, 0)
        asked.append((start, flags))
        got = (replies.pop(0) if replies else
               [e for e in extents if e.logical + e.length > start][:count])
        fm.HEADER.pack_into(buf, 0, start, length, flags, len(got), count, 0)
        for i, e in enumerate(got):
            fm.EXTENT.pack_into(buf, fm.HEADER.size + i * fm.EXTENT.size,
                                e.logical, e.physical, e.length, 0, 0, e.flags, 0, 0, 0)
        return 0

    monkeypatch.setattr(fsmap.fcntl, "ioctl", ioctl)
    return asked


def test_fiemap_asks_again_after_a_full_reply_and_syncs_once(monkeypatch):
    extents = [fm.Extent(i * 4096, (i + 10) * 8192, 4096, 0) for i in range(5)]
    extents[-1] = extents[-1]._replace(flags=fm.LAST)
    asked = fake_ioctl(monkeypatch, extents, [])
    assert fsmap.fiemap(3, 0, 1 << 20, per_call=2) == extents
    assert asked == [(0, fm.FIEMAP_FLAG_SYNC), (8192, 0), (16384, 0)]


def test_fiemap_refuses_a_full_reply_that_does_not_move_on(monkeypatch):
    stuck = [fm.Extent(0, 0, 4096, 0), fm.Extent(4096, 8192, 0, 0)]
    fake_ioctl(monkeypatch, [], [[fm.Extent(0, 0, 4096, 0), fm.Extent(4096, 0, 4096, 0)],
                                 stuck])
    with pytest.raises(fm.FiemapError, match="from 8192 ends at 4096, not past its start"):
        fsmap.fiemap(3, 0, 1 << 20, per_call=2)
