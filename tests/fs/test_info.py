"""The .nvmeof reports: the connection section of stats and stats.json, and the figures of
FUSE workers summed with the main process's."""

from __future__ import annotations

import json

from fakes import make_controller

from nvmeof_fuse.fs import info


def test_stats_show_the_connection_when_the_controller_reports_it():
    ctrl = make_controller((1, 512, 8))
    assert "connection" not in info.stats_dict(ctrl)
    ctrl.connection_snapshot = lambda: {"state": "live", "cntlid": 3, "losses": 1,
                                        "reconnects": 1}
    doc = json.loads(info.to_json(info.stats_dict(ctrl)))
    assert doc["connection"] == {"state": "live", "cntlid": 3, "losses": 1, "reconnects": 1}
    text = info.stats_text(ctrl).decode()
    assert "connection:\n  state      : live\n  cntlid     : 3\n  losses     : 1\n" in text


class _Companion:
    def info(self) -> dict:
        return {"socket": "@nvmeof-fuse-1", "uid": 1000}

    def snapshot(self) -> dict:
        return {"clients": 1, "daemon_copied_bytes": 0, "sessions": [
            {"peer": "pid 9 uid 1000", "regions": 2, "staged_read_bytes": 4096,
             "direct_read_bytes": 0, "placement": {"cuda": "staged: NVMe/TCP receives data"}}]}


def test_the_companion_handed_down_by_the_daemon_is_reported():
    ctrl = make_controller((1, 512, 8))
    assert info.companion_dict(None) == {"socket": None}
    assert "companion" not in info.stats_dict(ctrl)
    companion = _Companion()
    assert info.companion_dict(companion)["socket"] == "@nvmeof-fuse-1"
    assert info.stats_dict(ctrl, companion)["companion"]["sessions"][0]["regions"] == 2
    text = info.stats_text(ctrl, companion).decode()
    assert "companion:\n  clients" in text and "sessions" not in text
    assert ("companion client pid 9 uid 1000:\n  regions           : 2\n"
            "  staged_read_bytes : 4096\n"
            "  placement cuda    : staged: NVMe/TCP receives data\n") in text


def test_stats_of_many_namespaces_list_those_that_did_io_and_count_the_rest():
    """A target may have 65,536 namespaces: a report lists no empty statistics of each."""
    from types import SimpleNamespace

    from nvmeof_fuse.host.namespace import Namespace

    issuer = SimpleNamespace()  # no I/O here
    shape = SimpleNamespace(lba_size=512, nsze=8)
    ctrl = SimpleNamespace(namespaces={n: Namespace(issuer, n, shape) for n in range(1, 2001)})
    ns = ctrl.namespaces[1500]
    ns.stats.add("counted")
    doc = info.stats_dict(ctrl)
    assert [k for k in doc if k.startswith("n")] == ["n1500"] and doc["idle_namespaces"] == 1999
    assert info.stats_text(ctrl).decode().endswith("1999 more namespaces did no I/O\n")
    assert sum(n.io_stats is not None for n in ctrl.namespaces.values()) == 1  # none built
    del ctrl.namespaces[2000], ctrl.namespaces[1999]
    for n in range(1, 977):
        del ctrl.namespaces[n]
    assert len(ctrl.namespaces) == 1022 and "idle_namespaces" not in info.stats_dict(ctrl)


def test_stats_sum_every_worker_and_show_each():
    op = {"ops": 10, "bytes": 40960, "errors": 1,
          "latency_us": {"p50": 5.0, "p99": 9.0, "max": 12.0, "mean": 6.0}}
    main = {"n1": {"uptime_s": 1.0, "ops": {"read": op}, "counters": {"x": 1}}}
    worker = {"index": 1, "pid": 99, "namespaces": {"n1": {
        "ops": {"read": {**op, "ops": 30, "latency_us": {"p50": 4.0, "p99": 20.0,
                                                        "max": 30.0, "mean": 2.0}},
                "write": op}, "counters": {"x": 2}}}}

    class Companion:
        def snapshot(self):
            return {}

        def own_reports(self):
            return [worker]

    class Ctrl:
        namespaces = {1: type("Ns", (), {"io_stats": type("S", (), {
            "snapshot": staticmethod(lambda: main["n1"])})})()}

    doc = info.stats_dict(Ctrl(), Companion(), {"requests": 70, "parks": 9})
    read = doc["n1"]["ops"]["read"]
    assert (read["ops"], read["bytes"], read["errors"]) == (40, 40960 * 2, 2)
    assert read["latency_us"]["max"] == 30.0 and read["latency_us"]["mean"] == 3.0
    assert doc["n1"]["ops"]["write"]["ops"] == 10 and doc["n1"]["counters"] == {"x": 3}
    assert [w["index"] for w in doc["workers"]] == [0, 1]
    assert doc["workers"][0]["namespaces"]["n1"]["ops"]["read"]["ops"] == 10  # main's own
    assert doc["workers"][0]["requests"] == 70  # the FUSE requests the main process read
    assert doc["workers"][0]["parks"] == 9  # and its waits for them


def test_a_workers_messages_to_the_main_process_are_shown_per_request():
    """What a worker counted of its messages to the main process (issue #60): stats.json
    passes its report on, the text shows the per-request figure and the kinds it sent."""
    worker = {"index": 1, "pid": 7, "state": "live", "reconnects": 0, "qids": [3],
              "requests": 1000, "parks": 300,
              "to_main": {"lease": 1, "report": 4, "meta": 2, "read": 0, "meta OPEN": 1,
                          "meta FLUSH": 1},
              "to_main_per_request": 0.002, "namespaces": {}}

    class Companion:
        def snapshot(self):
            return {"clients": 0}

        def own_reports(self):
            return [worker]

    text = info.stats_text(make_controller((1, 512, 8)), Companion()).decode()
    assert "  to main per request : 0.002\n" in text and "  parks               : 300\n" in text
    assert "  to main             : lease 1, report 4, meta 2, meta OPEN 1, meta FLUSH 1\n" in text
    doc = info.stats_dict(make_controller((1, 512, 8)), Companion())
    assert doc["workers"][1]["to_main"]["meta OPEN"] == 1 and "requests" not in doc["workers"][0]


def test_stats_say_how_many_processes_serve_and_how_that_was_chosen():
    serving = {"processes": 1, "chosen": "auto: 2 usable cores"}
    doc = info.stats_dict(make_controller((1, 512, 8)), None, serving=serving)
    assert doc["serving"] == serving and "serving" not in info.stats_dict(make_controller())
    doc = info.stats_dict(make_controller((1, 512, 8)), None, {"requests": 5, "parks": 2},
                          serving)
    assert doc["serving"] == {**serving, "main": {"requests": 5, "parks": 2}}
    text = info.stats_text(make_controller((1, 512, 8)), None, serving).decode()
    assert "serving:\n  processes : 1\n  chosen    : auto: 2 usable cores\n" in text


def test_a_workers_tls_record_layer_is_shown_where_it_has_one():
    """A FUSE worker's own queues over TLS: stats name where their records go, as the main
    process's connection section does; a worker without TLS shows no such line."""
    workers = [{"index": 1, "pid": 7, "state": "live", "reconnects": 0, "qids": [3],
                "tls": "kernel (TLS_AES_128_GCM_SHA256)", "namespaces": {}},
               {"index": 2, "pid": 8, "state": "live", "reconnects": 0, "qids": [4],
                "namespaces": {}}]

    class Companion:
        def snapshot(self):
            return {"clients": 0}

        def own_reports(self):
            return workers

    text = info.stats_text(make_controller((1, 512, 8)), Companion()).decode()
    assert "FUSE worker 1:\n" in text and "  tls        : kernel (TLS_AES_128_GCM_SHA256)\n" in text
    assert text.split("FUSE worker 2:")[1].split("\n\n")[0].count("tls") == 0
    doc = info.stats_dict(make_controller((1, 512, 8)), Companion())
    assert doc["workers"][1]["tls"] == "kernel (TLS_AES_128_GCM_SHA256)"
