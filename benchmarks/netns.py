"""Shaped clusters on one machine: network namespaces joined by tbf-shaped veth links.

One namespace per worker (``tfgcb<pid>-w<i>``), each joined by a veth pair to a bridge
in a separate "switch" namespace (``tfgcb<pid>-sw``), with ``tc qdisc ... tbf rate R
burst 64kb latency 50ms`` on both ends of every link, so every byte a worker sends or
receives crosses a link of rate R. Workers get the private addresses 10.77.0.<i+1>/24,
which exist only inside these namespaces; nothing in the host's own namespace is
touched. Needs root, ``ip`` and ``tc`` (``preflight`` says why not).

Namespaces left by a driver that was killed outright (prefix ``tfgcb``, owner process
gone) are removed by ``clean_leftovers``. Standard library only.
"""

import os
import re
import shutil
import signal
import subprocess

# The benchmark drivers that build clusters: a namespace whose owner still runs one of
# them belongs to a sweep in progress.
DRIVERS = ("network.py", "time_to_accuracy.py")
NS_PREFIX = "tfgcb"
SUBNET = "10.77.0"  # workers are SUBNET.1 ... SUBNET.N, /24, inside our namespaces only
WORKER_DEV = "eth0"  # the worker's end of its veth pair (names are per namespace)
BRIDGE = "br0"
TBF = ("burst", "64kb", "latency", "50ms")


# Where iproute2 lives when PATH leaves the system directories out (a non-login shell, a
# CI runner's PATH of /usr/local/bin:/usr/bin:/bin): tc is often only in /usr/sbin.
SYSTEM_DIRS = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


class NetError(RuntimeError):
    pass


def tool(name):
    """The path of ``name`` (``ip``, ``tc``): on PATH, else in ``SYSTEM_DIRS``; None
    where it is in neither."""
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SYSTEM_DIRS))


def _ip(*argv, ns=None, check=True):
    cmd = [tool("ip") or "ip"] + (["-n", ns] if ns else []) + list(argv)
    return _run(cmd, check)


def _tc(*argv, ns, check=True):
    return _run([tool("ip") or "ip", "netns", "exec", ns, tool("tc") or "tc"] + list(argv),
                check)


def _run(cmd, check):
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetError(f"`{' '.join(cmd)}` could not run: {exc}") from None
    if check and proc.returncode != 0:
        raise NetError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                       f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def list_namespaces():
    proc = _ip("netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def namespace_pids(ns):
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def delete_namespace(ns):
    """Kills what still runs inside ``ns`` (only our workers can), then deletes it."""
    for pid in namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", ns, check=False)


def _owner_alive(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(driver in cmdline for driver in DRIVERS)


def clean_leftovers():
    """Deletes namespaces of earlier runs whose driver is gone; returns their names."""
    removed, kept = [], []
    for ns in list_namespaces():
        m = re.match(rf"^{NS_PREFIX}(\d+)-", ns)
        if not ns.startswith(NS_PREFIX):
            continue
        if m and int(m.group(1)) != os.getpid() and _owner_alive(int(m.group(1))):
            kept.append(ns)  # another sweep is running right now: leave it alone
            continue
        delete_namespace(ns)
        removed.append(ns)
    return removed, kept


def preflight():
    """None if this process can build a shaped cluster, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc); run it with sudo"
    for name in ("ip", "tc"):
        if tool(name) is None:
            return (f"`{name}` not found on PATH or in {', '.join(SYSTEM_DIRS)} "
                    "(install iproute2)")
    ns = f"{NS_PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", BRIDGE, "type", "bridge", ns=ns)
        _ip("link", "add", "p0", "type", "veth", "peer", "name", "p1", ns=ns)
        _tc("qdisc", "add", "dev", "p0", "root", "tbf", "rate", "100mbit", *TBF, ns=ns)
    except NetError as exc:
        return f"cannot build a shaped cluster here: {exc}"
    finally:
        _ip("netns", "del", ns, check=False)
    return None


class Cluster:
    """N worker namespaces on a bridge in a switch namespace, every link shaped."""

    def __init__(self, n):
        self.n = n
        base = f"{NS_PREFIX}{os.getpid()}"
        self.switch = f"{base}-sw"
        self.workers = [f"{base}-w{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.rate = None
        self.created = []

    def up(self):
        for ns in [self.switch] + self.workers:
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "add", BRIDGE, "type", "bridge", ns=self.switch)
        _ip("link", "set", BRIDGE, "up", ns=self.switch)
        for i, ns in enumerate(self.workers):
            port = f"vw{i}"
            _ip("link", "add", port, "type", "veth", "peer", "name", WORKER_DEV, "netns", ns,
                ns=self.switch)
            _ip("link", "set", port, "master", BRIDGE, ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
            _ip("addr", "add", f"{self.addresses[i]}/24", "dev", WORKER_DEV, ns=ns)
            _ip("link", "set", WORKER_DEV, "up", ns=ns)
        return self

    def links(self):
        """(namespace, device) of both ends of every worker's link."""
        for i, ns in enumerate(self.workers):
            yield ns, WORKER_DEV
            yield self.switch, f"vw{i}"

    def set_rate(self, rate):
        if rate == self.rate:
            return
        for ns, dev in self.links():
            _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, *TBF, ns=ns)
        self.rate = rate

    def reap(self):
        """Kills anything still running in the worker namespaces (between runs)."""
        for ns in self.workers:
            for pid in namespace_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def down(self):
        for ns in reversed(self.created):
            delete_namespace(ns)
        self.created = []


if __name__ == "__main__":
    # `python benchmarks/netns.py`: exit 0 when a shaped cluster can be built here, else
    # say why on stdout and exit 1 (scripts/demo.sh asks before it shapes a link).
    import sys
    why = preflight()
    if why:
        print(why)
    sys.exit(1 if why else 0)
