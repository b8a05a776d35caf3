"""The mount daemon's companion socket: other processes of the same user register memory.

The daemon listens on an abstract Unix ``SOCK_SEQPACKET`` socket whose name it
publishes in ``MOUNT/.nvmeof/companion.json``.  A client of another uid (other
than root) is refused with a one-line error.  Each accepted client gets a
:class:`~nvmeof_fuse.companion.server.session.ClientSession`; when the client closes or
dies, its in-flight requests finish and its registrations are released.  The mount's own
processes that use the socket too hold a role (:mod:`.roles`), registered at construction.
"""

from __future__ import annotations

import array
import errno
import logging
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from ...errors import InvalidArgument, NVMeoFError
from ...host.multipath.nearest import lease_wish
from ...host.multipath.path import path_options
from ...host.namespace import GONE
from .. import protocol
from ..protocol import Piece, ProtocolError
from .delegations import Delegations
from .path_leases import revoke_leases_of_moved_paths
from .roles import Role
from .session import ClientSession, CompanionStats, ReadOnly, Registered

log = logging.getLogger(__name__)

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Refused(NVMeoFError):
    errno = errno.EACCES


class NoLease(NVMeoFError):
    """No queue IDs for a client of its own: it uses the daemon's queues instead."""

    errno = errno.EBUSY


LOCK_GRACE = 30.0  # s a client may hold a write lock beyond the time its write was given
MAX_LISTED_SESSIONS = 8
"""Clients a ``stats`` reply lists (the asker's first): each entry's placement lines are
bounded, so that this many fit a message whatever the clients reported."""


def peer_allowed(peer_uid: int, owner_uid: int) -> bool:
    """Same user as the daemon, or root."""
    return peer_uid in (owner_uid, 0)


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[:len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def _shape(nsid: int, ns: Any) -> list[int]:
    """A lease's ``[nsid, lba_size, nlb, generation]`` of ``ns`` (GONE once removed)."""
    return [nsid, ns.lba_size, ns.nlb,
            GONE if getattr(ns, "removed", False) else getattr(ns, "generation", 0)]


class CompanionServer:
    """Serves companion clients of one mounted controller."""

    def __init__(self, controller: Any, *, read_only: bool = False,
                 roles: Sequence[Role] = ()) -> None:
        self.controller = controller
        self.read_only = read_only
        self.owner_uid = os.geteuid()
        self.address = f"\0nvmeof-fuse/{os.getpid()}/{secrets.token_hex(8)}"
        self.roles = tuple(roles)
        """The mount's own kinds of process (:mod:`.roles`); each keeps the last queue IDs."""
        self._kept = sum(role.queues for role in self.roles)  # queue IDs the roles keep
        self._role_requests = {op: (role, handler) for role in self.roles
                          for op, handler in role.requests.items()}
        self.stats = CompanionStats(own={name: 0 for role in self.roles
                                         for name in (role.counter, role.counter + "_total")})
        self.sessions: set[ClientSession] = set()
        self.quarantine: list[Registered] = []  # regions whose command timed out
        # Awaited with the nsid, offset and length (0: all of it) after each write, before
        # the client hears it is done: the mount drops the kernel's cached pages there,
        # which the write went around.
        self.on_write: Callable[[int, int, int], Awaitable[None]] | None = None
        self._locked: dict[trio.Event, tuple[int, int, int]] = {}  # lock -> nsid, its bytes
        self.delegations = Delegations(self._written)

    def info(self) -> dict[str, Any]:
        """What ``.nvmeof/companion.json`` shows: where and whose the socket is."""
        return {"socket": "@" + self.address[1:], "pid": os.getpid(), "uid": self.owner_uid,
                "version": protocol.VERSION}

    async def _written(self, nsid: int, offset: int = 0, length: int = 0) -> None:
        if self.on_write is not None:
            await self.on_write(nsid, offset, length)

    def snapshot(self, asking: ClientSession | None = None) -> dict[str, Any]:
        """The companion counters, and each client's (``sessions``).  For a client's
        ``stats`` request (``asking``) the list starts with its own and holds at most
        :data:`MAX_LISTED_SESSIONS`, so that the reply fits a message; ``sessions_omitted``
        counts the rest."""
        clients = [s for s in self.sessions if s.role is None]
        omitted = 0
        if asking is not None:
            clients.sort(key=lambda s: s is not asking)
            omitted = max(0, len(clients) - MAX_LISTED_SESSIONS)
            clients = clients[:MAX_LISTED_SESSIONS]
        return {**self.stats.snapshot(),
                "delegations_granted": self.delegations.granted,
                "delegations_recalled": self.delegations.recalled,
                "sessions": [{"peer": s.peer, "regions": len(s.regions), "qids": s.qids,
                              "lease_transport": s.lease_transport if s.qids else "",
                              **({"lease_path": s.lease_path}
                                 if s.qids and s.lease_path is not None else {}),
                              **s.counts, "placement": s.placement}
                             for s in clients],
                **({"sessions_omitted": omitted} if omitted else {})}

    def has_client(self, pid: int) -> bool:
        """Whether process ``pid`` still has a session (its queue IDs are still its own)."""
        return any(s.peer.startswith(f"pid {pid} ") for s in self.sessions)

    def own_reports(self) -> list[dict[str, Any]]:
        """What each of the mount's own processes last reported of itself (a role's
        session, :mod:`.roles`), with the queue IDs it holds."""
        return [{**s.own_report, "qids": s.qids} for s in self.sessions
                if s.own_report is not None]

    def new_session(self, peer: str, pid: int | None = None) -> ClientSession:
        session = ClientSession(self.controller, self.stats, peer, read_only=self.read_only,
                          quarantine=self.quarantine)
        session.pid = pid
        self.sessions.add(session)
        self.stats.clients += 1
        self.stats.clients_total += 1
        return session

    def end_session(self, session: ClientSession) -> None:
        session.end_waits()
        session.close()
        self._unlease(session)
        self.sessions.discard(session)
        if session.role is not None:
            self.stats.own[session.role.counter] -= 1
        else:
            self.stats.clients -= 1

    def close(self) -> None:
        for session in list(self.sessions):
            self.end_session(session)
        for reg in self.quarantine:
            reg.release()
        self.quarantine.clear()

    # -- the socket ------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Listen until cancelled; ``task_status.started()`` once clients can connect."""
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await listener.bind(self.address)
            listener.listen(64)
            task_status.started()
            async with trio.open_nursery() as nursery:
                if any(not self.leasing(role) for role in (None, *self.roles)):
                    nursery.start_soon(self._revoke_leases_on_loss)
                while True:
                    conn, _ = await listener.accept()
                    nursery.start_soon(self._client, conn)
        finally:
            listener.close()
            self.close()

    async def _client(self, conn: trio.socket.SocketType) -> None:
        with conn:
            pid, uid, _gid = _CREDS.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
            if not peer_allowed(uid, self.owner_uid):
                self.stats.refused += 1
                log.warning("companion: refused pid %d of uid %d", pid, uid)
                refusal = Refused(f"uid {uid} may not use this mount: it belongs to uid "
                                  f"{self.owner_uid} (only that user and root may)")
                with trio.move_on_after(1):
                    await conn.send(protocol.reply_error(0, refusal))
                    # Read what the client sent before closing: closing a Unix socket with
                    # unread data resets the peer, which would lose the refusal unread.
                    conn.shutdown(socket.SHUT_WR)
                    while await conn.recv(protocol.MAX_MESSAGE):
                        pass
                return
            session = self.new_session(f"pid {pid} uid {uid}", pid)
            send_lock = trio.Lock()

            async def notify(event: dict[str, Any]) -> bool:
                async with send_lock:
                    with trio.move_on_after(1):  # a client that reads nothing is not waited for
                        try:
                            await conn.send(protocol.encode({"id": 0, "ok": True, **event}))
                            return True
                        except (OSError, NVMeoFError) as exc:  # gone, or too large to send
                            log.debug("companion: an event for pid %d not sent: %s", pid, exc)
                            return False
                    log.debug("companion: an event for pid %d not sent within 1 s", pid)
                    return False

            session.notify = notify
            log.info("companion: client pid %d connected", pid)
            try:
                await self._requests(conn, session, send_lock)
            finally:
                self.end_session(session)
                log.info("companion: client pid %d gone; its registrations are released", pid)

    async def _requests(self, conn: trio.socket.SocketType, session: ClientSession,
                        send_lock: trio.Lock) -> None:
        async with trio.open_nursery() as nursery:  # exits once in-flight requests are done
            session.nursery = nursery
            try:
                while True:
                    try:
                        data, ancdata, flags, _ = await conn.recvmsg(
                            protocol.MAX_MESSAGE, socket.CMSG_SPACE(protocol.MAX_FDS * 4))
                    except OSError:
                        return
                    fds = received_fds(ancdata)
                    if not data and not fds:
                        return  # the client closed (or died)
                    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                        for fd in fds:
                            os.close(fd)
                        log.warning("companion: %s sent an oversized message; closing",
                                    session.peer)
                        return
                    nursery.start_soon(self._answer, conn, send_lock, session, data, fds)
            finally:
                session.end_waits()  # its locks go; its commands in flight still finish

    async def _answer(self, conn: trio.socket.SocketType, send_lock: trio.Lock,
                      session: ClientSession, data: bytes, fds: list[int]) -> None:
        request_id = 0
        try:
            header, payload = protocol.decode(data)
            request_id = header.get("id") if isinstance(header.get("id"), int) else 0
            self.stats.requests += 1
            result = await self.dispatch(session, header, payload, fds)
            fds = []  # dispatch took them
            data = result.pop("_payload", b"")  # bytes back (a role's handler may give some)
            reply = protocol.encode({"id": request_id, "ok": True, **result}, data)
        except protocol.PlacementRefused as exc:  # expected: counted as such, not an error
            reply = protocol.reply_error(request_id, exc)
        except NVMeoFError as exc:
            self.stats.errors += 1
            reply = protocol.reply_error(request_id, exc)
        except Exception as exc:  # a bug must not take the mount down
            self.stats.errors += 1
            log.exception("companion: request failed")
            reply = protocol.reply_error(request_id, RuntimeError(f"internal error: {exc}"))
        finally:
            for fd in fds:
                os.close(fd)
        async with send_lock:
            try:
                await conn.send(reply)
            except OSError:
                pass  # the client is gone; its session ends with the connection

    async def dispatch(self, session: ClientSession, header: dict, payload: bytes,
                       fds: list[int]) -> dict[str, Any]:
        """Run one request; takes ownership of ``fds`` (closing them on error)."""
        op = header.get("op")
        f = protocol.field
        if op == "register":
            if len(fds) != 1:
                raise ProtocolError(f"register needs one file descriptor, got {len(fds)}")
            if header.get("kind") == "dmabuf":  # fields checked before the fd is taken
                offset, length, iova = f(header, "offset"), f(header, "length"), f(header, "iova")
                rid = session.register_dmabuf(fds.pop(), offset, length, iova)
            else:
                length = f(header, "length")
                rid = session.register_memfd(fds.pop(), length,
                                             bool(header.get("staging", False)))
            return {"region": rid}
        for fd in fds:
            os.close(fd)
        fds.clear()
        if op == "hello":
            nsid = f(header, "nsid") if "nsid" in header else None
            if nsid is not None:  # a File of it: bound to this namespace, not to the NSID
                session.pin(nsid)
            return self.hello(nsid)
        if op == "read":
            pieces = [Piece.from_list(p) for p in f(header, "pieces", list)]
            await session.read(f(header, "nsid"), pieces)
            return {}
        if op == "write":
            head_len, tail_len = f(header, "head"), f(header, "tail")
            if head_len < 0 or tail_len < 0 or head_len + tail_len != len(payload):
                raise ProtocolError(f"write carries {len(payload)} edge bytes, "
                                    f"not {head_len}+{tail_len}")
            await self.write(session, f(header, "nsid"), f(header, "offset"),
                             f(header, "length"), f(header, "region"),
                             f(header, "region_offset"), payload[:head_len], payload[head_len:])
            return {}
        if op == "unregister":
            session.unregister(f(header, "region"))
            return {}
        if op == "lease":  # a lease again first counts the bytes moved on the last one's path
            session.report(header.get("moved") or {})
            return await self.lease(session, f(header, "want"), role=self._claimed(header),
                                    nsids=protocol.nsids_field(header), **lease_wish(header))
        if op in self._role_requests:  # one only a role's sessions send
            role, handler = self._role_requests[op]
            self._check_role(session, role, op)
            return await handler(session, header, payload)
        if op in ("add_path", "remove_path"):
            return await self.change_path(op, str(f(header, "uri", str)))
        if op == "unlease":
            self._unlease(session)
            return {}
        if op == "lock":
            return await self.lock(session, f(header, "nsid"), f(header, "offset"),
                                   f(header, "length"), f(header, "hold_s"),
                                   delegate=header.get("delegate") is True)
        if op == "unlock":
            session.report(header.get("moved") or {})
            await self.unlock(session, f(header, "token"), f(header, "nsid"))
            return {}
        if op == "report":  # also renews the client's delegations: those still its own
            session.report(header.get("moved") or {}, header.get("placement"))
            self._own_report(session, header)
            return {"delegated": self.delegations.live_tokens(session)}
        if op == "stats":
            session.report(header.get("moved") or {}, header.get("placement"))
            return {"stats": self.snapshot(session)}
        raise ProtocolError(f"unknown companion request {op!r}")

    async def change_path(self, op: str, uri: str) -> dict[str, Any]:
        """``nvmeof-fuse add-path`` / ``remove-path``: change the mount's paths (a refusal
        is the one-line error the CLI prints)."""
        head = self.controller
        if not hasattr(head, "add_path"):
            raise InvalidArgument("this mount has no multipath head: its paths cannot change")
        if op == "add_path":
            path = await head.add_path(path_options(head.paths[0].options, uri))
        else:
            path = await head.remove_path(uri)
        return {"index": path.index, "uri": path.uri}

    def _unlease(self, session: ClientSession) -> None:
        if session.qids:
            session.qids = []
            if session.role is None:
                self.stats.leases -= 1

    # -- the mount's own processes (roles) ---------------------------------------------------

    def _claimed(self, header: dict) -> Role | None:
        """The role a ``lease`` request claims by its flag (None: a companion client's)."""
        return next((role for role in self.roles if header.get(role.flag) is True), None)

    @staticmethod
    def _check_role(session: ClientSession, role: Role, op: str) -> None:
        """Only a session holding ``role`` (it leased the role's queues) sends ``op``."""
        if not role.queues:
            raise ProtocolError(f"this mount has no {role.name}s")
        if session.role is not role:
            raise ProtocolError(f"{op}: only the mount's {role.name}s (after their lease) "
                                f"send {op} requests")

    def _own_report(self, session: ClientSession, header: dict) -> None:
        """A role's session reports its own figures under the role's flag."""
        for role in self.roles:
            if isinstance(header.get(role.flag), dict):
                if session.role is not role:
                    raise ProtocolError(f"report: only a {role.name} (after its lease) "
                                        f"reports a {role.name}'s counts")
                session.own_report = header[role.flag]

    def _take_role(self, session: ClientSession, role: Role) -> None:
        """A session that leases a role's queues is one of the mount's own processes:
        counted under the role's counter, not ``clients``."""
        if session.role is role:
            return
        session.role = role
        stats = self.stats
        stats.clients -= 1
        stats.clients_total -= 1
        stats.own[role.counter] += 1
        stats.own[role.counter + "_total"] += 1

    async def tell(self, role: Role, event: dict[str, Any]) -> list[ClientSession]:
        """Send ``event`` to every session holding ``role``: those it was sent to."""
        told = []
        for session in list(self.sessions):
            if session.role is role and session.notify is not None:
                if await session.notify(event):
                    told.append(session)
        return told

    # -- queues of a client's own ----------------------------------------------------------

    def leasing(self, role: Role | None = None) -> str:
        """Why clients (or the sessions of ``role``) cannot have queues of their own here;
        empty when they can.  A role's processes move data through memory of their own,
        on any transport."""
        ctrl = self.controller
        options = getattr(ctrl, "options", None)
        if role is not None:
            return "" if role.queues else f"this mount has no {role.name}s"
        if options is None or options.companion_queues <= self._kept:
            return "queue leasing is off on this mount (--companion-queues 0)"
        if not getattr(ctrl.transport, "places_in_other_processes", False):
            return (f"the mount's {ctrl.transport.name} transport gives no direct placement "
                    "into another process's memory")
        return ""

    async def follow(self, changes: list) -> None:
        """Namespaces removed or replaced on the target (a listener of ``host.events``): a
        client whose own queues serve one it opened is told they are revoked; asking for
        its lease again it learns that the namespace is gone, and its queues serve another
        under that name never (:func:`_shape`).  (After a reconnect every client is told
        anyway; the mount's own processes (roles) take the new generations from their
        events.)"""
        gone = {c.nsid for c in changes if c.kind in ("removed", "replaced")}
        if not gone:
            return
        for session in list(self.sessions):
            if (session.qids and session.role is None and session.notify is not None
                    and gone.intersection(session.pinned)):
                await session.notify({"event": "revoked", "state": "namespace changed"})

    async def _revoke_leases_on_loss(self) -> None:
        """When the controller is lost, tell every client with queues of its own at once.

        Their queues belonged to the lost controller; without a keep-alive of their own
        they would only find out when a command timed out.  They ask for a lease again,
        which waits for the reconnect.
        """
        ctrl = self.controller
        if hasattr(ctrl, "lease_controller"):  # a multipath head: leases live on a path
            await revoke_leases_of_moved_paths(ctrl, self.sessions)
            return
        told = False  # since the controller was last live (resetting, then connecting: once)
        while True:
            if await ctrl.next_state() == "live":
                told = False
                continue
            if told:
                continue
            told = True
            for session in list(self.sessions):
                if session.qids and session.notify is not None:
                    await session.notify({"event": "revoked", "state": ctrl.state})

    async def lease(self, session: ClientSession, want: int, role: Role | None = None,
                    nsids: list[int] | None = None, **wish: Any) -> dict[str, Any]:
        """Queue IDs for ``session`` to connect itself, and how (waits while reconnecting);
        of those kept for ``role``, when it claims one.

        A session keeps its queue IDs until it ends; asking again (after its queues
        failed) waits for the controller to be live and names its controller ID.  The reply
        names the namespaces ``nsids`` names (:meth:`named_nsids`), and the path (lease_wish).
        """
        why = self.leasing(role)
        if why:
            raise NoLease(why)
        if role is not None:
            self._take_role(session, role)
        ctrl = self.controller
        choose = getattr(ctrl, "lease_controller", None)  # a multipath head: pick a path
        with session.waiting() as wait:
            if choose is not None:
                ctrl = await choose(session.lease_place, any_transport=role is not None, **wish,
                                    load=lambda c: sum(s.lessor is c for s in self.sessions))
            else:
                await ctrl.wait_live(fail_fast=False)
        if wait.cancelled_caught:
            raise NoLease("the client went away while waiting for its lease")
        if choose is not None:
            opts = ctrl.options
            session.lessor = ctrl
            session.lease_wish = wish
            session.lease_place = (opts.transport, opts.traddr, opts.trsvcid)
        if not session.qids:
            taken = {q for s in self.sessions for q in s.qids}
            pool = self._pool(ctrl.lease_qids, role)
            free = [q for q in pool if q not in taken]
            if not free and role is not None:
                raise NoLease(f"all {len(pool)} queue IDs of this mount's {role.name}s are "
                              "taken")
            if not free:
                self.stats.lease_refusals += 1
                raise NoLease(f"all {len(ctrl.lease_qids)} companion queues of this mount are "
                              "leased (--companion-queues)")
            session.qids = free[:max(1, want)]
            if role is None:
                self.stats.leases += 1
            log.info("companion: %s leases queues %s", session.peer,
                     ",".join(map(str, session.qids)))
        opts = ctrl.options
        session.lease_transport = ctrl.transport.name
        path = self.controller.nearness(ctrl, wish.get("near")) if choose else None
        session.lease_path = path["index"] if path else None
        return {
            "qids": session.qids, "cntlid": ctrl.cntlid, "transport": ctrl.transport.name,
            "traddr": opts.traddr, "trsvcid": opts.trsvcid, "host_traddr": opts.host_traddr,
            "host_iface": opts.host_iface, "subnqn": opts.nqn, "hostnqn": ctrl.identity.hostnqn,
            "hostid": str(ctrl.identity.hostid), "queue_size": ctrl.io_queue_size(),
            "in_capsule_bytes": ctrl.in_capsule_bytes, "max_transfer": ctrl.max_transfer,
            "timeout": opts.timeout, "reconnect_delay": opts.reconnect_delay,
            "ctrl_loss_tmo": opts.ctrl_loss_tmo, "fast_io_fail_tmo": opts.fast_io_fail_tmo,
            "namespaces": self.namespace_shapes(
                nsids, max_named=role.max_named if role is not None else None,
                pinned=session.pinned),
            "namespace_count": len(self.controller.namespaces),
            **self._secrets(opts, ctrl.identity.hostnqn),
            **({"path": path} if choose else {}),
        }

    def named_nsids(self, nsids: list[int] | None = None) -> list[int]:
        """The mount's namespaces of ``nsids`` (all without them), sorted."""
        namespaces = self.controller.namespaces
        if nsids is None:
            return sorted(namespaces)
        return sorted(n for n in set(nsids) if n in namespaces)

    def _pool(self, qids: list[int], role: Role | None) -> list[int]:
        """The leasable queue IDs of ``role``'s sessions, or of companion clients': the
        roles keep the last ones, each its share in the order they were registered."""
        start = max(0, len(qids) - self._kept)
        if role is None:
            return qids[:start]
        for each in self.roles:
            if each is role:
                return qids[start:start + role.queues]
            start += each.queues
        return []

    def namespace_shapes(self, nsids: list[int] | None = None, *,
                         max_named: int | None = None,
                         pinned: dict[int, Any] | None = None) -> list[list[int]]:
        """``[nsid, lba_size, nlb, generation]`` of the namespaces ``nsids`` names, as a
        lease names them (a client addresses them by these).  Without ``nsids``: all while
        they fit a reply (:func:`~..protocol.fits_budget`), or while they are at most
        ``max_named`` when given (a role's lease); else none.  ``pinned``: the namespaces a
        client holds (its session's): one since removed or replaced is named with the
        generation ``GONE``, so that the client's queues never serve another under its
        name."""
        namespaces = self.controller.namespaces
        named = self.named_nsids(nsids)
        if pinned and nsids is not None:
            named = sorted(set(named) | (set(nsids) & set(pinned)))
        shapes = [_shape(n, (pinned or {}).get(n) or namespaces[n]) for n in named]
        if nsids is None and (len(shapes) > max_named if max_named is not None
                              else not protocol.fits_budget(shapes)):
            return []
        return shapes

    @staticmethod
    def _secrets(opts: Any, hostnqn: str) -> dict[str, Any]:
        """The DH-HMAC-CHAP secrets and TLS PSK the client's queues authenticate with, as the
        mount does (its secret files read, and checked, now).

        Only a client of the mount's uid or root gets here: one that could read them anyway.
        They travel in the reply alone, never in a log line or an error.
        """
        from ...host.auth import SecretSource, secret_sources

        found: dict[str, Any] = {}
        sources = secret_sources(getattr(opts, "dhchap_secret", None),
                                 getattr(opts, "dhchap_ctrl_secret", None))
        allow = getattr(opts, "allow_insecure_secret_file", False)
        for name, source in zip(("dhchap_secret", "dhchap_ctrl_secret"), sources, strict=True):
            if source is not None:
                found[name] = source.text(allow)
        tls_key = getattr(opts, "tls_key", None)
        if tls_key:  # the TLS PSK each of the client's connections offers, as the mount's
            found["tls_key"] = SecretSource.of(tls_key, "--tls-key").text(allow)
            found["tls_compat"] = bool(getattr(opts, "tls_compat", False))
        elif getattr(opts, "uses_tls", False):  # from the mount's keyring, which the client
            psk = opts.tls_psk(hostnqn)           # may not read: the PSK it resolved
            found["tls_psk"] = {"identity": psk.identity, "key": psk.key.hex()}
        return found

    async def lock(self, session: ClientSession, nsid: int, offset: int, length: int,
                   timeout: float, delegate: bool = False) -> dict[str, Any]:
        """Hold the range lock of a write the client makes on its own queues: its token.

        Held until :meth:`unlock`, the client's end, or ``timeout`` plus a grace.  With
        ``delegate``, the whole namespace instead when nobody else uses it (``delegated``
        in the reply; :mod:`~nvmeof_fuse.companion.server.delegations`).  (FUSE workers
        take their locks themselves: :mod:`~nvmeof_fuse.host.namespace.sharedranges`.)
        """
        if self.read_only:
            raise ReadOnly("the namespace is mounted read-only")
        ns = session.namespace(nsid)
        if offset < 0 or length <= 0 or offset + length > ns.size:
            raise InvalidArgument(f"bad write lock: offset {offset}, length {length} on "
                                  f"namespace {nsid} ({ns.size} bytes)")
        if timeout < 0:
            raise InvalidArgument(f"bad write lock: hold_s {timeout} is negative")
        assert session.nursery is not None
        limit = timeout + LOCK_GRACE
        if delegate:
            token = await self.delegations.grant(session, ns, nsid, limit)
            if token is not None:
                return {"token": token, "delegated": True}
        release = trio.Event()

        async def hold(task_status: trio.TaskStatus[None]) -> None:
            with trio.move_on_after(limit) as held:
                async with ns.write_locked(offset, length):
                    self._locked[release] = (nsid, offset, length)
                    try:
                        task_status.started()
                        await release.wait()
                    finally:
                        self._locked.pop(release, None)
            if held.cancelled_caught:
                log.warning("companion: %s held a write lock on n%d for over %g s; released",
                            session.peer, nsid, limit)

        with session.waiting():
            await session.nursery.start(hold)
            if session.ended:  # it went as the lock came: end_waits() could not release it
                release.set()
                raise NoLease("the client went away while waiting for a write lock")
            session.next_token += 1
            session.write_locks[session.next_token] = release
            return {"token": session.next_token}
        raise NoLease("the client went away while waiting for a write lock")

    async def unlock(self, session: ClientSession, token: int, nsid: int) -> None:
        """The client's write is done: drop cached pages, then release its lock (or the
        client hands back its delegation)."""
        delegation = self.delegations.of(session, token)
        if delegation is not None:
            await self.delegations.hand_back(delegation)
            return
        release = session.write_locks.pop(token, None)
        if release is None:
            raise InvalidArgument(f"write lock {token} is not held")
        try:
            await self._written(*self._locked.get(release, (nsid, 0, 0)))
        finally:
            release.set()

    async def write(self, session: ClientSession, nsid: int, offset: int, length: int,
                    *args: Any) -> None:
        """``session.write(nsid, offset, length, *args)``, then ``on_write``."""
        await session.write(nsid, offset, length, *args)
        await self._written(nsid, offset, length)

    def placement(self) -> dict[str, str]:
        """What this daemon can place a client's data in directly: ``"on"``, or why not."""
        refusal = getattr(self.controller.transport, "dmabuf_refusal", "")
        return {"memfd": "on", "dmabuf": refusal or "on"}

    def hello(self, nsid: int | None = None) -> dict[str, Any]:
        """What the mount is and offers; ``namespaces`` names namespace ``nsid`` (when it is
        here), or without it all of them while they fit a reply, else none; and
        ``namespace_count`` counts all of them."""
        ctrl = self.controller
        described = {str(n): {"size": ns.size, "lba_size": ns.lba_size, "nlb": ns.nlb}
                     for n in self.named_nsids(None if nsid is None else [nsid])
                     for ns in [ctrl.namespaces[n]]}
        if nsid is None and not protocol.fits_budget(described):
            described = {}
        return {
            "version": protocol.VERSION,
            "read_only": self.read_only,
            "max_transfer": ctrl.max_transfer,
            "leasing": self.leasing() or "on",
            "placement": self.placement(),
            "namespaces": described,
            "namespace_count": len(ctrl.namespaces),
        }
