"""An emulated interconnect for CPU runs: a network namespace whose loopback is shaped by tc's token
bucket filter, so that an all-reduce mostly waits for the wire, as on a slow interconnect (on plain
loopback it costs CPU, and 2 ranks on 2 cores leave none to overlap). Needs root and iproute2. MTU
1500: tbf drops a packet larger than its bucket, and a 64 KiB one would let all-reduces pass unshaped.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

from ..errors import UsageError

LOOPBACK = "loopback"
_PREFIX = "ladder-bench-"
_RATE = re.compile(r"^\d+(\.\d+)?[kmgt]?bit$")
# Bucket and queue: a few packets of burst keeps the rate exact at millisecond scale; a long queue
# limit (1 s) avoids drops, since TCP retransmission timeouts would swamp every measurement.
_BURST, _QUEUE_LATENCY = "4kb", "1s"


def check_rate(rate: str) -> str:
    if rate != LOOPBACK and not _RATE.match(rate):
        raise UsageError(
            f"link {rate!r} is not '{LOOPBACK}' or a rate in bits per second such as 20mbit, 500kbit, 1gbit"
        )
    return rate


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip().splitlines()
        raise UsageError(f"`{' '.join(command)}` failed: {message[0] if message else f'exit {result.returncode}'}")


def _remove_stale_namespaces() -> None:
    """Namespaces of killed runs (their process is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for pid in re.findall(rf"^{_PREFIX}(\d+)(?=\s|$)", listing, re.MULTILINE):
        if not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", f"{_PREFIX}{pid}"], capture_output=True)


@contextlib.contextmanager
def emulated_link(rate: str) -> Iterator[list[str]]:
    """The command prefix that runs a program on a loopback shaped to `rate` (none for plain loopback)."""
    if rate == LOOPBACK:
        yield []
        return
    if missing := [tool for tool in ("ip", "tc") if shutil.which(tool) is None]:
        raise UsageError(
            f"--link needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2, or use --link {LOOPBACK}"
        )
    if os.geteuid() != 0:
        raise UsageError(f"--link needs root to create a network namespace; run as root or use --link {LOOPBACK}")
    _remove_stale_namespaces()
    name = f"{_PREFIX}{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        inside = ("ip", "netns", "exec", name)
        _run(*inside, "ip", "link", "set", "lo", "mtu", "1500", "up")
        _run(*inside, *f"tc qdisc add dev lo root tbf rate {rate} burst {_BURST} latency {_QUEUE_LATENCY}".split())
        yield list(inside)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
