"""scripts/soak_guest.py's arithmetic (the soak itself runs in the VM: ``scripts/soak``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak_guest.py"
spec = importlib.util.spec_from_file_location("soak_guest", SCRIPT)
assert spec is not None and spec.loader is not None
soak_guest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak_guest)


def snapshot(at: float, idle: float, busy: float, main: float, workers: float, fio: float,
             reader: float, n1_mb: float) -> dict:
    machine = dict.fromkeys(soak_guest.MACHINE_FIELDS, 0.0)
    machine.update(idle=idle, user=busy)
    return {"at": at, "machine": machine, "main": main, "workers": workers, "fio": fio,
            "reader": reader, "n1_bytes": int(n1_mb * 1e6), "n2_bytes": 0}


def test_cpu_use_charges_each_side_per_mb_and_the_rest_to_the_kernel():
    first = snapshot(0, idle=10, busy=100, main=5, workers=0, fio=3, reader=1, n1_mb=0)
    last = snapshot(10, idle=11, busy=119, main=9, workers=4, fio=5, reader=2, n1_mb=100)
    use = soak_guest.cpu_use(first, last)
    assert use["seconds"] == 10 and use["n1_mb"] == 100
    assert use["busy"] == 0.95  # 19 of 20 s
    assert use["cpu_s"] == {"main": 4, "workers": 4, "fio": 2, "reader": 1, "rest": 8}
    assert use["cpu_ms_per_n1_mb"]["main"] == 40 and use["cpu_ms_per_n1_mb"]["rest"] == 80


def test_compare_sums_each_counts_soaks_against_the_first_counts(capsys):
    def result(workers: int, mb: int) -> dict:
        return {"workers": workers, "cpu": None,
                "fio": {"read_bytes": mb * 10**6 // 2, "written_bytes": mb * 10**6 // 2}}

    soak_guest.compare([result(1, 100), result(2, 95), result(2, 80), result(1, 90)])
    out = capsys.readouterr().out
    assert out.startswith("2 workers moved 0.92x the bytes of 1 (175 MB against 190 MB")
    assert "2 and 2 soaks, in the order 1 2 2 1" in out
