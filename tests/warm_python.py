"""``python ARGUMENTS`` for the tests, forked from a warm interpreter rather than started fresh.

A fresh interpreter spends about 4 s of CPU importing torch and transformers before it does what a
test started it for. :func:`run_python` hands the command to a server (``tests/warm_server.py``)
started once per environment (the same variables, those a child sets after the fork aside:
``tests/warm_server.py``'s ``PER_CHILD_VARIABLES``), which has
imported those two and frozen them out of garbage collection; its fork becomes ``python -c CODE``,
``python -m MODULE`` or ``python SCRIPT`` with the working folder, environment and standard
streams asked for, and ends as that interpreter would (``tests/test_warm_python.py`` compares).

What such a child has that a fresh one lacks: torch and transformers (and what they import) are in
``sys.modules`` before the program starts; the hash seed, ``sys.orig_argv`` and ``sys.flags`` are
the server's. The start-up hook (``safelens_tl.pth``) ran in the server as it runs in every
interpreter, and runs again in the child with the child's ``SAFELENS_TL_AUTOPATCH``: it waits for
``transformer_lens`` unless that says no. So the tests whose subject is start-up
itself (what an import loads, the hook, interpreter options) start fresh interpreters
(``subprocess``), and so does :func:`run_python` for an interpreter option other than ``-c`` and
``-m``. ``SAFELENS_TL_TESTS_FRESH=1`` makes every child a fresh interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import locale
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.warm_server import PER_CHILD_VARIABLES

SERVER = Path(__file__).with_name("warm_server.py")
#: Set to 1 to start every child fresh (for telling a problem of the fork from one of the test).
FRESH_VARIABLE = "SAFELENS_TL_TESTS_FRESH"
#: How long a server may take to import what it preloads.
START_TIMEOUT = 300.0


class _Server:
    """One warm interpreter and the folder of its socket."""

    def __init__(self, environment: Mapping[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="safelens-warm-")
        self.address = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(environment),
            cwd=self.folder,
        )
        assert self.process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        if not selector.select(START_TIMEOUT):
            self.process.kill()
            raise RuntimeError(f"the warm interpreter did not start in {START_TIMEOUT} s")
        line = self.process.stdout.readline()
        if line != b"ready\n":
            raise RuntimeError(f"the warm interpreter did not start: {line!r}")

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)


_servers: dict[frozenset[tuple[str, str]], _Server] = {}
_servers_lock = threading.Lock()


@atexit.register
def _close_servers() -> None:
    with _servers_lock:
        while _servers:
            _servers.popitem()[1].close()


def _server(environment: Mapping[str, str]) -> _Server:
    key = frozenset(
        (name, value) for name, value in environment.items() if name not in PER_CHILD_VARIABLES
    )
    with _servers_lock:
        if key not in _servers or _servers[key].process.poll() is not None:
            _servers[key] = _Server({name: value for name, value in key})
        return _servers[key]


def _decoded(data: bytes) -> str:
    """As ``subprocess.run(text=True)`` decodes: the locale's encoding, universal newlines."""
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")


def run_python(
    arguments: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *arguments], capture_output=True, text=True, ...)``, the
    child forked from a warm interpreter where the arguments allow (module docstring)."""
    environment = dict(os.environ if env is None else env)
    command = [sys.executable, *arguments]
    first = arguments[0] if arguments else "-"
    if (
        os.environ.get(FRESH_VARIABLE) == "1"
        or (first.startswith("-") and first not in ("-c", "-m"))
        or (first in ("-c", "-m") and len(arguments) < 2)
    ):
        return subprocess.run(
            command, capture_output=True, text=True, cwd=cwd, env=environment, timeout=timeout
        )
    if first in ("-c", "-m"):
        kind, target, rest = first, arguments[1], list(arguments[2:])
    else:
        kind, target, rest = "script", os.path.abspath(first), list(arguments[1:])
    request = {
        "kind": kind,
        "target": target,
        "arguments": rest,
        "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
        "per_child": {name: environment.get(name) for name in PER_CHILD_VARIABLES},
    }
    return _run_forked(_server(environment), request, command, timeout)


def _run_forked(
    server: _Server, request: dict[str, object], command: list[str], timeout: float
) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + timeout
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(server.address)
        payload = json.dumps(request).encode() + b"\n"
        socket.send_fds(connection, [payload], [stdin, out_write, err_write])
    finally:
        for fd in (stdin, out_write, err_write):
            os.close(fd)
    output = {out_read: bytearray(), err_read: bytearray()}
    replies = bytearray()
    selector = selectors.DefaultSelector()
    for fd in output:
        selector.register(fd, selectors.EVENT_READ)
    selector.register(connection, selectors.EVENT_READ)
    pid: int | None = None
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            events = selector.select(max(left, 0)) if left > 0 else []
            if not events:
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(
                    command, timeout, bytes(output[out_read]), bytes(output[err_read])
                )
            for key, _ in events:
                if key.fileobj is connection:
                    data = connection.recv(4096)
                    replies += data
                    if pid is None and b"\n" in replies:
                        pid = int(replies.split(b"\n")[0].split()[1])
                else:
                    assert isinstance(key.fileobj, int)
                    data = os.read(key.fileobj, 65536)
                    output[key.fileobj] += data
                if not data:
                    selector.unregister(key.fileobj)
    finally:
        selector.close()
        connection.close()
        for fd in output:
            os.close(fd)
    lines = replies.decode().split()
    if len(lines) != 4 or lines[0] != "pid" or lines[2] != "exit":
        raise RuntimeError(f"the warm interpreter answered {replies!r}")
    return subprocess.CompletedProcess(
        command, int(lines[3]), _decoded(bytes(output[out_read])), _decoded(bytes(output[err_read]))
    )
