"""A warm interpreter that forks children for the tests (the client is ``tests/warm_python.py``).

Run as ``python tests/warm_server.py SOCKET_PATH`` with the environment its children are to have.
It imports torch and transformers (with its modeling base), which every child that loads a model
would import first, listens on a Unix socket, and for each request forks a child that becomes
``python -c CODE``, ``python -m MODULE`` or ``python SCRIPT`` with the arguments, working folder
and standard streams the request names. It exits when its standard input closes (the test
process ended).

Standalone on purpose: it imports nothing of the tests or of safelens_tl, so that what a child
finds imported is what site start-up (including ``safelens_tl.pth``) plus these imports leave.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import json
import os
import runpy
import selectors
import socket
import sys
import tempfile
import types
from typing import Any, NoReturn

#: Imported before serving. Every child that loads a TransformerLens or Hugging Face model imports
#: them first; none reads anything at import that a child may change but the environment, and a
#: server serves one environment only. ``transformers`` itself imports lazily: its modeling base
#: (``PreTrainedModel``, which every model class and TransformerLens import) costs each child
#: another 1.0-1.8 s of CPU. TransformerLens is not preloaded: importing it runs safelens-tl's
#: start-up hook, which the children's programs must meet as a fresh interpreter does.
PRELOADED = ("torch", "transformers", "transformers.modeling_utils")
#: Imported before serving where installed: TransformerLens imports them (``datasets``, with
#: pandas: 0.3-0.7 s of each child's CPU), and they import neither TransformerLens nor
#: safelens-tl.
PRELOADED_IF_INSTALLED = ("datasets",)
#: Variables a child may have other than the server's, set after the fork, since nothing reads
#: them before: tempfile reads ``TMPDIR`` on first use; pytest names the test running in
#: ``PYTEST_CURRENT_TEST``, which would otherwise make every test start a server of its own;
#: safelens-tl reads its switches when TransformerLens is imported (the start-up hook's opt-out
#: is read again after the fork, see :func:`_become_child`); torch sets
#: ``TORCHINDUCTOR_CACHE_DIR`` in the test process at its first compilation and reads it at each;
#: a child pytest reads ``PYTEST_ADDOPTS`` and the tests' conftest ``TOX_ENV_NAME``. Every other
#: variable keys a server of its own (``HF_HOME``, ``PYTHONWARNINGS``: read at import or start-up).
PER_CHILD_VARIABLES = (
    "TMPDIR",
    "PYTEST_CURRENT_TEST",
    "SAFELENS_TL_AUTOPATCH",
    "SAFELENS_TL_DISABLE",
    "TORCHINDUCTOR_CACHE_DIR",
    "PYTEST_ADDOPTS",
    "TOX_ENV_NAME",
)
#: This file, as its frames name it (read now: the child replaces this main module).
SERVER_FILE = __file__
#: The largest request, in bytes (a documentation snippet is a few kilobytes).
LARGEST_REQUEST = 1 << 20


def _become_child(request: dict[str, Any]) -> NoReturn:
    """In the forked child: set up what a fresh ``python ARGUMENTS`` would have, run it and leave
    by ``SystemExit``, so that the interpreter ends as it would (``atexit``, threads, flushing)."""
    os.setpgid(0, 0)  # one group, so that a timeout kills the child's own children too
    os.chdir(request["cwd"])
    for name in PER_CHILD_VARIABLES:
        value = request["per_child"].get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None
    startup = sys.modules.get("safelens_tl._startup")
    if startup is not None:
        # The start-up hook (safelens_tl.pth) read SAFELENS_TL_AUTOPATCH in the server: arm or
        # disarm it again with the child's value, as a fresh interpreter's start-up would.
        startup.install()
    importlib.invalidate_caches()
    sys.path_importer_cache.clear()
    kind, target, arguments = request["kind"], request["target"], request["arguments"]
    # A main module of its own, as a fresh interpreter has: -m runs the module's code in it.
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        if kind == "-c":
            sys.argv = ["-c", *arguments]
            sys.path[0] = ""
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif kind == "-m":
            sys.argv = ["-m", *arguments]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target)  # type: ignore[attr-defined]  # what -m runs
        else:
            sys.argv = [target, *arguments]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as error:
        # As the interpreter reports an uncaught exception: without this file's frames, nor
        # those of runpy.run_path, which a script run by the interpreter does not pass through.
        hidden = {SERVER_FILE} if kind == "-m" else {SERVER_FILE, "<frozen runpy>"}
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename in hidden:
            traceback = traceback.tb_next
        sys.excepthook(type(error), error.with_traceback(traceback), traceback)
        raise SystemExit(1) from None
    raise SystemExit(0)


def serve(address: str) -> None:
    """Import :data:`PRELOADED`, then fork a child per request until standard input closes."""
    for name in PRELOADED:
        importlib.import_module(name)
    for name in PRELOADED_IF_INSTALLED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # What the imports made is never garbage: the children's collections need not walk it (and,
    # walking it, copy every page the fork shares).
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    while True:
        # Children are reaped by polling: a SIGCHLD handler would be inherited by every child.
        for key, _ in selector.select(timeout=0.01 if running else None):
            if key.fileobj is sys.stdin:
                return
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, LARGEST_REQUEST, 3)
            while message and not message.endswith(b"\n"):
                more = connection.recv(LARGEST_REQUEST)
                if not more:  # the client left before its request ended
                    break
                message += more
            if not message.endswith(b"\n") or len(fds) != 3:  # nothing to run
                for fd in fds:
                    os.close(fd)
                connection.close()
                continue
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in (connection, *running.values()):
                    other.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                _become_child(request)
            for fd in fds:
                os.close(fd)
            _send(connection, f"pid {pid}\n")
            running[pid] = connection
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = running.pop(pid)
                _send(connection, f"exit {os.waitstatus_to_exitcode(status)}\n")
                connection.close()


def _send(connection: socket.socket, message: str) -> None:
    """Answer a client, which may be gone (it stops listening when its child runs too long)."""
    with contextlib.suppress(OSError):
        connection.sendall(message.encode())


if __name__ == "__main__":
    serve(sys.argv[1])
