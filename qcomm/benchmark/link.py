r"""
The emulated network link of ``qcomm bench --link RATE`` (see :doc:`/bench`):
a network namespace per host (per rank, or per ``--ranks-per-host`` ranks,
which talk over its loopback), joined by veth devices shaped to ``RATE``
each way with ``tc``'s token-bucket filter; two hosts by one veth pair, more
through a bridge. Namespaces are named after this process
(``qcomm-<pid>-...``): those of a run killed outright are removed by the next.
Needs iproute2's ``ip`` and ``tc``, and root or, for another user, the
``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN`` capabilities as ambient ones (the
``ip`` and ``tc`` it runs inherit only those), with ``CAP_DAC_OVERRIDE`` too
unless ``/run/netns`` is writable.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from types import FrameType, TracebackType
from typing import Any

from qcomm.benchmark.children import Stopped

__all__ = ["Link", "LinkError", "parse_rate", "tc_rate"]

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_PREFIX = "qcomm-"
_SUBNET = "10.213.0"
_INTERFACE = "eth0"
# Capability bits (linux/capability.h).
_CAP_DAC_OVERRIDE = 1
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
_CAP_NAMES = {
    _CAP_DAC_OVERRIDE: "CAP_DAC_OVERRIDE",
    _CAP_NET_ADMIN: "CAP_NET_ADMIN",
    _CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
}
_STATUS = "/proc/self/status"
# Where `ip netns add` makes its files (in /run when the folder is not there).
_NETNS_DIR = "/run/netns"


class LinkError(RuntimeError):
    r"""The emulated link cannot be set up; the message says what is missing."""


def parse_rate(text: str) -> float:
    r"""
    parse_rate(text: str) -> float

    Bits per second of a rate of at least 1 kbit/s; a bad one raises
    ``ValueError`` naming ``--link``.

    Args:
        text (str): as ``tc`` writes it: ``1gbit``, ``100mbit``, ``2.5g``.

    Examples::

        >>> parse_rate("10gbit"), parse_rate("100mbit"), parse_rate("2.5g")
        (10000000000.0, 100000000.0, 2500000000.0)
    """
    match = _RATE.match(text)
    if match is None or match.group(3) and match.group(3).lower() == "bps":
        raise ValueError(
            f"--link: expected a rate in bits per second like 1gbit, 10gbit or 100mbit, "
            f"got {text!r}"
        )
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    if not value >= 1e3:
        raise ValueError(f"--link: expected a rate of at least 1kbit, got {text!r}")
    return value


def tc_rate(bits_per_second: float) -> str:
    r"""
    tc_rate(bits_per_second: float) -> str

    The rate as ``tc`` reads it, in kilobits per second.

    Args:
        bits_per_second (float): the rate.

    Examples::

        >>> tc_rate(1e10), tc_rate(2.5e9)
        ('10000000kbit', '2500000kbit')
    """
    return f"{round(bits_per_second / 1e3)}kbit"


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale() -> None:
    # Namespaces of runs that were killed outright (SIGKILL) and could not
    # clean up after themselves.
    for name in _namespaces():
        match = re.match(rf"^{_PREFIX}(\d+)-", name)
        if match and not _alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _capabilities(status: str, field: str = "CapEff") -> int | None:
    # One capability set (a hex bit mask) of /proc/<pid>/status text; None
    # where the line is missing or unreadable (not Linux, an old kernel).
    for line in status.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() == field:
            try:
                return int(value.strip(), 16)
            except ValueError:
                return None
    return None


def _cap_list(bits: list[int]) -> str:
    names = [_CAP_NAMES[bit] for bit in bits]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _privilege_problem(euid: int, status: str | None, netns_writable: bool) -> str | None:
    # What --link lacks to make namespaces and shape them, or None. `status`
    # is the text of /proc/self/status (None: unreadable).
    needed = [_CAP_NET_ADMIN, _CAP_SYS_ADMIN]
    if euid == 0:
        # Root's children get its capabilities, unless a container withheld them.
        effective = _capabilities(status or "")
        if effective is None:
            return None
        missing = [bit for bit in needed if not effective >> bit & 1]
        if not missing:
            return None
        return (
            f"--link needs the {_cap_list(needed)} capabilities (network namespaces and "
            f"tc); this process runs as root without {_cap_list(missing)} (CapEff): give "
            f"them to its container (e.g. docker run --cap-add NET_ADMIN --cap-add "
            f"SYS_ADMIN, or --privileged)"
        )
    # Another user's children (ip, tc) inherit only its ambient capabilities:
    # effective ones from setcap on the interpreter do not reach them.
    dac = (
        ""
        if netns_writable
        else f", and {_CAP_NAMES[_CAP_DAC_OVERRIDE]} ({_NETNS_DIR} is not writable)"
    )
    if not netns_writable:
        needed.append(_CAP_DAC_OVERRIDE)
    ambient = _capabilities(status or "", "CapAmb") or 0
    effective = _capabilities(status or "", "CapEff") or 0
    missing = [bit for bit in needed if not ambient >> bit & 1]
    if not missing:
        return None
    only_effective = [bit for bit in missing if effective >> bit & 1]
    note = (
        f"; it has {_cap_list(only_effective)} only in effect (as setcap on the "
        f"interpreter gives), which ip and tc do not inherit"
        if only_effective
        else ""
    )
    caps = ",".join(f"+{_CAP_NAMES[bit][4:].lower()}" for bit in needed)
    return (
        f"--link needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN{dac} as ambient "
        f"capabilities, which the ip and tc it runs inherit; this process (uid {euid}) "
        f"lacks {_cap_list(missing)} among them (CapAmb){note}. Run it as root, or e.g. "
        f"`sudo setpriv --reuid=$(id -u) --regid=$(id -g) --init-groups --inh-caps={caps} "
        f"--ambient-caps={caps} qcomm bench --link ...`"
    )


def _check_privileges(status_path: str | None = None) -> None:
    # Raises LinkError naming what is missing; changes nothing.
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(
            f"--link needs the {' and '.join(missing)} command(s) of iproute2 on PATH "
            f"(e.g. apt-get install iproute2)"
        )
    try:
        with open(status_path or _STATUS) as f:
            status: str | None = f.read()
    except OSError:
        status = None
    folder = _NETNS_DIR if os.path.isdir(_NETNS_DIR) else os.path.dirname(_NETNS_DIR)
    problem = _privilege_problem(os.geteuid(), status, os.access(folder, os.W_OK))
    if problem:
        raise LinkError(problem)


class Link:
    r"""
    The emulated link of one run, as a context manager: entering builds it,
    leaving (normal end, error, Ctrl-C or SIGTERM) removes it.

    Args:
        world_size (int): ranks.
        bits_per_second (float): the rate of every port, each direction.
        ranks_per_host (int, optional): ranks per namespace, ranks numbered
            host by host; they share its address and talk over its loopback,
            unshaped. Default: ``1``.

    Raises:
        ValueError: if ``ranks_per_host`` does not divide ``world_size``.
        LinkError: if the link cannot be built; nothing is left behind.

    Examples::

        >>> link = Link(2, 1e9)
        >>> link.address(0), link.command(1, ["python"])[:4]  # doctest: +ELLIPSIS
        ('10.213.0.1', ['ip', 'netns', 'exec', 'qcomm-...-r1'])
        >>> hosts = Link(4, 1e9, ranks_per_host=2)
        >>> [hosts.address(r) for r in range(4)]
        ['10.213.0.1', '10.213.0.1', '10.213.0.2', '10.213.0.2']
        >>> hosts.namespace(1) == hosts.namespace(0) != hosts.namespace(2)
        True
    """

    def __init__(self, world_size: int, bits_per_second: float, ranks_per_host: int = 1) -> None:
        if ranks_per_host < 1 or world_size % ranks_per_host:
            raise ValueError(
                f"ranks_per_host: expected a divisor of the world size {world_size}, "
                f"got {ranks_per_host}"
            )
        self.world_size = world_size
        self.bits_per_second = bits_per_second
        self.ranks_per_host = ranks_per_host
        #: namespaces joined by the shaped link
        self.hosts = world_size // ranks_per_host
        self._tag = f"{_PREFIX}{os.getpid()}"
        self._made: list[str] = []
        self._old_handler: Any = None
        #: every host's link device (what ``GLOO_SOCKET_IFNAME`` names)
        self.interface = _INTERFACE

    def host(self, rank: int) -> int:
        r"""
        host(rank: int) -> int

        The host (namespace) of a rank, ``rank // ranks_per_host``.

        Args:
            rank (int): the rank.
        """
        return rank // self.ranks_per_host

    def _host_namespace(self, host: int) -> str:
        # One rank per host keeps the names of one namespace per rank.
        kind = "r" if self.ranks_per_host == 1 else "h"
        return f"{self._tag}-{kind}{host}"

    def namespace(self, rank: int) -> str:
        r"""
        namespace(rank: int) -> str

        The network namespace of a rank's host: ``qcomm-<pid>-r<rank>`` with
        one rank per host, else ``qcomm-<pid>-h<host>``.

        Args:
            rank (int): the rank.
        """
        return self._host_namespace(self.host(rank))

    def address(self, rank: int) -> str:
        r"""
        address(rank: int) -> str

        A rank's IPv4 address on the link, its host's: e.g. ``"10.213.0.1"``
        for rank 0.

        Args:
            rank (int): the rank.
        """
        return f"{_SUBNET}.{self.host(rank) + 1}"

    def command(self, rank: int, argv: list[str]) -> list[str]:
        r"""
        command(rank: int, argv: list[str]) -> list[str]

        ``argv`` run inside the namespace of ``rank``.

        Args:
            rank (int): the rank.
            argv (list[str]): the command.
        """
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    def _switch(self) -> str | None:
        # Two hosts are joined by one veth pair; more by a bridge in a namespace of its own.
        return None if self.hosts == 2 else f"{self._tag}-switch"

    def _shaped(self) -> list[tuple[str, str]]:
        # Every (namespace, device) whose egress is shaped.
        hosts = [(self._host_namespace(h), _INTERFACE) for h in range(self.hosts)]
        switch = self._switch()
        if switch is None:
            return hosts
        return hosts + [(switch, f"port{h}") for h in range(self.hosts)]

    def set_shaping(self, on: bool) -> None:
        r"""
        set_shaping(on: bool) -> None

        Puts the rate limit back, or lifts it; raises :class:`LinkError` if
        ``tc`` fails.

        Args:
            on (bool): ``False``: the devices run as fast as the CPUs move the data.
        """
        for namespace, device in self._shaped():
            if on:
                _run(*self._shape(namespace, device, "replace"))
            else:
                _run("ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root")

    def _shape(self, namespace: str, device: str, verb: str = "add") -> list[str]:
        rate = tc_rate(self.bits_per_second)
        # The bucket holds about a millisecond of traffic (at least 128 KiB):
        # enough for the kernel's timer to keep the rate, too little to
        # change a transfer's duration.
        burst = max(128 * 1024, int(self.bits_per_second / 8 / 1000))
        return [
            "ip", "netns", "exec", namespace, "tc", "qdisc", verb, "dev", device,
            "root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms",
        ]  # fmt: skip

    def plan(self) -> list[list[str]]:
        r"""
        plan() -> list[list[str]]

        The ``ip`` and ``tc`` commands that build the link, in order: a
        namespace per host with its loopback up, the veth devices between
        them (a pair, or one to each port of a bridge), each host's address
        and the shaping of every port. Entering runs them.

        Examples::

            >>> plan = Link(4, 1e9, ranks_per_host=2).plan()
            >>> sum(argv[:3] == ["ip", "netns", "add"] for argv in plan)  # two hosts, no switch
            2
        """
        hosts = [self._host_namespace(h) for h in range(self.hosts)]
        switch = self._switch()
        out: list[list[str]] = []
        for name in hosts if switch is None else [*hosts, switch]:
            out += [["ip", "netns", "add", name], ["ip", "-n", name, "link", "set", "lo", "up"]]
        if switch is None:
            out.append(
                ["ip", "-n", hosts[0], "link", "add", _INTERFACE, "type", "veth",
                 "peer", "name", _INTERFACE, "netns", hosts[1]]
            )  # fmt: skip
        else:
            out.append(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
            out.append(["ip", "-n", switch, "link", "set", "br0", "up"])
            for h, name in enumerate(hosts):
                port = f"port{h}"
                out += [
                    ["ip", "-n", name, "link", "add", _INTERFACE, "type", "veth",
                     "peer", "name", port, "netns", switch],
                    ["ip", "-n", switch, "link", "set", port, "master", "br0"],
                    ["ip", "-n", switch, "link", "set", port, "up"],
                    self._shape(switch, port),
                ]  # fmt: skip
        for h, name in enumerate(hosts):
            address = f"{self.address(h * self.ranks_per_host)}/24"
            out += [
                ["ip", "-n", name, "addr", "add", address, "dev", _INTERFACE],
                ["ip", "-n", name, "link", "set", _INTERFACE, "up"],
                self._shape(name, _INTERFACE),
            ]
        return out

    def _build(self) -> None:
        for argv in self.plan():
            _run(*argv)
            if argv[:3] == ["ip", "netns", "add"]:
                self._made.append(argv[3])  # made: removed on the way out, whatever happens

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # SIGTERM ends the run like Ctrl-C does, through the cleanup below.
        raise Stopped(signum)

    def __enter__(self) -> Link:
        _check_privileges()
        _remove_stale()
        try:
            self._old_handler = signal.signal(signal.SIGTERM, self._on_signal)
        except ValueError:  # not the main thread: SIGTERM keeps its handler
            self._old_handler = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        r"""
        close() -> None

        Removes every namespace this link made (their devices go with them).
        """
        while self._made:
            subprocess.run(["ip", "netns", "delete", self._made.pop()], capture_output=True)
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
