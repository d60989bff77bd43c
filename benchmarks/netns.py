"""A second "host" on this machine: a Linux network namespace joined to this one by a
veth pair, for benchmarks and tests that need a real network hop between a client
and its shards (benchmarks/transport.py --netns, tests/client/test_crosshost.py).

    with Far.create() as far:           # NetnsUnavailable: not root, no `ip`, EPERM
        shard = start_shard([..., "--listen", f"{far.peer_addr}:0"], prefix=far.prefix)
        ...                              # the client stays here, reaches far.peer_addr
        far.link_down(); far.link_up()   # a network fault, and its end

Inside the namespace only its `lo` and its end of the veth exist: its loopback and
its abstract unix sockets are its own, so a shard there is not on "this host" for
the client (the shm plane's test fails) and every byte crosses the veth. The
namespace is named `exd-<pid>-<n>`, its veth ends `x<pid><n>h` (here) and
`x<pid><n>p` (there); the /30 it uses is the first free one in 10.213.0.0/16 from
a place picked by the pid, that no address or route of this namespace
overlaps (two runs that start at once could still pick the same one). Namespaces left behind by dead processes are removed on the next
create; close() (or the context's end) removes this one.

A fault is the far end's link set down: packets to it are dropped silently (no
reset, no ICMP), as on a cut cable. Setting this side's end down instead would
remove the /30's route and send the shards' packets to this machine's default
gateway.
"""

from __future__ import annotations

import ctypes
import ipaddress
import itertools
import os
import re
import shutil
import subprocess
import time

RANGE = ipaddress.ip_network("10.213.0.0/16")
PREFIX = "exd-"
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2
_count = itertools.count()


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise subprocess.CalledProcessError(
            done.returncode, ["ip", *args], done.stdout, done.stderr
        )
    return done


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the exd-<pid>-<n> namespaces whose process is gone -> their names."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _taken() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix this namespace has an address or a route in (but broad ones,
    /0 to /7, which a /30 of its own overrides)."""
    nets = []
    text = (
        _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    )
    for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text):
        try:
            net = ipaddress.ip_network(word, strict=False)
        except ValueError:
            continue
        if net.prefixlen >= 8:
            nets.append(net)
    return nets


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """The first /30 of RANGE, from the place `seed` picks, that overlaps nothing here."""
    taken = _taken()
    subnets = list(RANGE.subnets(new_prefix=30))
    start = seed % len(subnets)
    for net in subnets[start:] + subnets[:start]:
        if not any(net.overlaps(t) for t in taken):
            return net
    raise NetnsUnavailable(f"no free /30 left in {RANGE}")


def enter(name: str) -> None:
    """Move this process into network namespace `name` as `ip netns exec` does: the
    namespace, then a mount namespace of its own with that namespace's /sys (libraries
    that list the network devices there, such as UCX under NIXL, would otherwise see
    this side's). For a helper process, forked or spawned, before it starts a thread or
    opens a socket."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ok: bool, what: str) -> None:
        if not ok:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (netns {name}): {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET) == 0, "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS) == 0, "unshare of the mount namespace")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) == 0, "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH) == 0, "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None) == 0, "mount sysfs")


class Far:
    """A network namespace and the veth pair to it (see the module's docstring)."""

    def __init__(self, name: str, host_if: str, peer_if: str, net: ipaddress.IPv4Network):
        self.name = name
        self.host_if, self.peer_if = host_if, peer_if
        hosts = list(net.hosts())
        self.net = net
        self.host_addr, self.peer_addr = str(hosts[0]), str(hosts[1])
        self.closed = False

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    @classmethod
    def create(cls) -> Far:
        """Make the namespace, the veth pair and its addresses; NetnsUnavailable when
        this machine or user cannot (the reason says which step failed and how)."""
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
        remove_stale()
        pid, n = os.getpid(), next(_count)
        name = f"{PREFIX}{pid}-{n}"
        host_if, peer_if = f"x{pid}{n}h", f"x{pid}{n}p"  # at most 15 characters
        try:
            _ip("netns", "add", name)
        except subprocess.CalledProcessError as e:
            raise NetnsUnavailable(f"`ip netns add` failed: {e.stderr.strip()}") from None
        try:
            _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
            _ip("link", "set", peer_if, "netns", name)
            far = cls(name, host_if, peer_if, free_subnet(pid * 7 + n))
            _ip("addr", "add", f"{far.host_addr}/30", "dev", host_if)
            _ip("link", "set", host_if, "up")
            _ip("-n", name, "addr", "add", f"{far.peer_addr}/30", "dev", peer_if)
            _ip("-n", name, "link", "set", peer_if, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            far.wait_link()
            subprocess.run([*far.prefix, "true"], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            _ip("link", "del", host_if, check=False)
            _ip("netns", "del", name, check=False)
            cmd = " ".join(map(str, e.cmd))
            raise NetnsUnavailable(f"`{cmd}` failed: {(e.stderr or '').strip()}") from None
        except BaseException:
            _ip("link", "del", host_if, check=False)
            _ip("netns", "del", name, check=False)
            raise
        return far

    def wait_link(self, timeout: float = 10.0) -> None:
        """Until this side's end has a carrier (both ends up)."""
        deadline = time.monotonic() + timeout
        while "LOWER_UP" not in _ip("link", "show", self.host_if).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.host_if} has no carrier after {timeout:.0f} s")
            time.sleep(0.05)

    def link_down(self) -> None:
        """Cut the wire: the far end's link down, packets to it dropped without a word."""
        _ip("-n", self.name, "link", "set", self.peer_if, "down")

    def link_up(self) -> None:
        _ip("-n", self.name, "link", "set", self.peer_if, "up")
        self.wait_link()

    def close(self) -> None:
        """Remove the veth pair and the namespace (stop the processes inside first: a
        namespace lives on while a process is in it)."""
        if self.closed:
            return
        self.closed = True
        _ip("link", "del", self.host_if, check=False)  # both ends, at once
        _ip("netns", "del", self.name, check=False)

    def __enter__(self) -> Far:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Far({self.name}: {self.host_addr} {self.host_if} <-> {self.peer_if} {self.peer_addr})"
        )
