"""A TCP proxy for fault injection: put it between a client and one shard server
and break the link on command.

    proxy = FaultProxy("127.0.0.1:50051")   # listens on proxy.address
    proxy.stall()        # bytes stop flowing both ways, connections stay open (a hung peer)
    proxy.reset()        # every connection is cut with a TCP RST, new ones too (a crash)
    proxy.slow(0.05)     # each chunk waits 50 ms before it is forwarded (a slow link)
    proxy.heal()         # back to a clean pipe; stalled bytes flow on

Threads and plain sockets only (nothing of gRPC), so what the client sees is
what a real network failure looks like. Pumps poll every few ms instead of
blocking, so a mode change reaches connections already open.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

TICK = 0.01  # s: how often an idle pump looks at the mode


class _Link:
    """One client connection and its upstream twin."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.sockets = (client, upstream)
        self.closed = False
        self._lock = threading.Lock()

    def close(self, rst: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in self.sockets:
            if rst:  # linger 0: close() sends RST instead of FIN, as a crashed peer's kernel does
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()


class FaultProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self._mode, self._delay = "pass", 0.0
        self._links: list[_Link] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(TICK * 10)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open = True
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()

    # -- commands --------------------------------------------------------------------

    def stall(self) -> None:
        self._mode = "stall"

    def slow(self, delay_s: float) -> None:
        self._delay, self._mode = delay_s, "slow"

    def reset(self) -> None:
        self._mode = "reset"
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close(rst=True)

    def heal(self) -> None:
        self._mode = "pass"

    def close(self) -> None:
        self._open = False
        self.reset()
        self._listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------

    def _accept(self) -> None:
        while self._open:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if self._mode == "reset":
                _Link(client, socket.socket()).close(rst=True)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # the server is gone: the client sees a reset, as it would directly
                _Link(client, socket.socket()).close(rst=True)
                continue
            link = _Link(client, upstream)
            with self._lock:
                self._links = [x for x in self._links if not x.closed] + [link]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(link, src, dst), daemon=True).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not link.closed:
                if (
                    self._mode == "stall"
                ):  # read nothing: the peers' buffers fill, as on a hung host
                    time.sleep(TICK)
                    continue
                if not select.select([src], [], [], TICK)[0]:
                    continue
                data = src.recv(1 << 16)
                if not data:
                    break
                if self._mode == "slow":
                    time.sleep(self._delay)
                dst.sendall(data)
        except (OSError, ValueError):  # ValueError: select() on a socket a reset just closed
            pass
        link.close(rst=False)
