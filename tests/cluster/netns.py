"""Two hosts on one machine: two network namespaces joined by a veth pair (tests/cluster/test_two_hosts.py).

    with TwoHosts() as hosts:                       # pytest: the `two_hosts` fixture there
        hosts.a.ip, hosts.b.ip                      # 10.X.Y.1 and 10.X.Y.2, the two ends of the veth
        proc = hosts.a.popen([sys.executable, script, ...], env=...)
        hosts.link_down()                           # `ip link set <a's end> down`: the cable pulled

Each host is a network namespace (`ip netns add td-<pid>-<n>-a`) with loopback up and one veth end
addressed in a /24 of its own, so nothing it binds is reachable from the other host except over the
veth. Each process also gets a UTS namespace (`unshare --uts`) whose host name is the host's, so
tinydist's host key (`tinydist.dist.rendezvous.host_key`: host name and boot id) tells the two
apart exactly as it tells two machines apart, with no test-only override; /dev/shm stays shared, as
it would not be between machines, which is why only the host key decides the transport.

Names carry this process's pid and a counter, so concurrent runs (other worktrees, CI jobs) never
collide; the subnet is derived from them too (it only exists inside the two namespaces, so it cannot
clash with the machine's own routes). Everything is removed in `close()` (the processes killed, both
namespaces deleted, which deletes the veth with them), also when a test fails, and once more at
exit; namespaces a killed earlier run left behind (its pid gone) are swept at the next start.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2's `ip` and util-linux's `unshare`;
`unavailable()` says which one is missing, for the skip reason.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "td-"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why two namespaces cannot be made here (the skip reason), or None when they can."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): network namespaces and veth pairs need CAP_SYS_ADMIN/CAP_NET_ADMIN"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install {package}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _sweep_stale() -> None:
    """Delete namespaces of earlier runs whose process is gone (a SIGKILLed pytest cannot clean up)."""
    listed = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({re.escape(PREFIX)}(\d+)-\S+)", listed, flags=re.M):
        pid = int(name[1])
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name[0], check=False)


@dataclass
class Host:
    name: str              # the network namespace, also the host name its processes see
    ip: str                # its veth end's address
    device: str            # its veth end's interface name
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host: its network namespace, its own UTS namespace named after it."""
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)


class TwoHosts:
    def __init__(self) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        _sweep_stale()
        n = next(_counter)
        tag = f"{os.getpid()}-{n}"
        # 10.(100..199).(0..255).0/24 from pid and counter: distinct across concurrent runs in practice,
        # and private to the two namespaces either way
        seed = os.getpid() * 7 + n
        net = f"10.{100 + (seed >> 8) % 100}.{seed & 0xff}"
        self.a = Host(f"{PREFIX}{tag}-a", f"{net}.1", f"td{tag}a"[-15:])
        self.b = Host(f"{PREFIX}{tag}-b", f"{net}.2", f"td{tag}b"[-15:])
        self._closed = False
        atexit.register(self.close)
        try:
            for host in (self.a, self.b):
                _ip("netns", "add", host.name)
            _ip("link", "add", self.a.device, "netns", self.a.name, "type", "veth",
                "peer", "name", self.b.device, "netns", self.b.name)
            for host in (self.a, self.b):
                _ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", host.device)
                _ip("-n", host.name, "link", "set", "lo", "up")
                _ip("-n", host.name, "link", "set", host.device, "up")
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def link_down(self) -> None:
        """Take host a's end of the veth down: both ends lose carrier, packets in flight are dropped,
        no socket is closed (as when a cable is pulled or a switch port dies)."""
        _ip("-n", self.a.name, "link", "set", self.a.device, "down")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            for proc in host.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
            _ip("netns", "del", host.name, check=False)     # deletes its veth end, and with it the pair
        atexit.unregister(self.close)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def leftovers() -> list[str]:
    """Namespaces of this process still present (for the tests' cleanup check)."""
    listed = _ip("netns", "list", check=False).stdout
    return re.findall(rf"^({re.escape(PREFIX)}{os.getpid()}-\S+)", listed, flags=re.M)
