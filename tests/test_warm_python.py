"""The tests' warm children (``tests/warm_python.py``) against fresh interpreters: the same program
sees the same arguments, import path, folders, ``__main__`` and environment, and leaves the same
output and exit status, for ``-c``, ``-m`` and a script, whether it returns, exits or raises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm_python import run_python

pytestmark = pytest.mark.release_independent

PROBE = """\
import atexit, json, os, sys, tempfile, threading

atexit.register(lambda: print("atexit ran", flush=True))


def late():
    import time

    time.sleep(0.2)
    print("non-daemon thread finished", flush=True)


threading.Thread(target=late).start()
seen = {
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "name": __name__,
    "file": globals().get("__file__"),
    "main": sorted(name for name in globals() if not name.startswith("__")),
    "tmp": tempfile.gettempdir(),
    "variable": os.environ.get("PROBE_VARIABLE"),
}
print(json.dumps(seen))
print("to stderr", file=sys.stderr)
if sys.argv[-1] == "raise":
    raise ValueError("raised by the probe")
if sys.argv[-1] == "exit":
    sys.exit("exit message")
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe_module.py").write_text(PROBE, encoding="utf-8")
    return folder


@pytest.mark.parametrize("ending", ["return", "exit", "raise"])
@pytest.mark.parametrize("kind", ["-c", "-m", "script"])
def test_a_warm_child_runs_as_a_fresh_interpreter(
    kind: str, ending: str, probe: Path, tmp_path: Path
) -> None:
    arguments = {
        "-c": ["-c", PROBE, "first", ending],
        "-m": ["-m", "probe_module", "first", ending],
        "script": [str(probe / "probe_module.py"), "first", ending],
    }[kind]
    environment = {**os.environ, "TMPDIR": str(tmp_path), "PROBE_VARIABLE": "set"}
    warm = run_python(arguments, cwd=probe, env=environment, timeout=120)
    fresh = subprocess.run(
        [sys.executable, *arguments],
        cwd=probe,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert warm.returncode == {"return": 0, "exit": 1, "raise": 1}[ending]
    assert '"tmp": "' + str(tmp_path) in warm.stdout
    assert "atexit ran" in warm.stdout and "non-daemon thread finished" in warm.stdout


def test_a_warm_child_that_runs_too_long_is_killed(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=1)


#: What the start-up hook left in an interpreter: its state, and whether its watcher waits for
#: ``transformer_lens`` on ``sys.meta_path``.
HOOK_PROBE = (
    "import json, sys; hook = sys.modules.get('safelens_tl._startup'); "
    "print(json.dumps([getattr(hook, 'state', None), "
    "any(type(finder).__name__ == '_Watcher' for finder in sys.meta_path)]))"
)


def test_a_warm_child_meets_the_start_up_hook_as_its_own_opt_out_says() -> None:
    """``SAFELENS_TL_AUTOPATCH`` is a child's own: one server (which starts without it, the one
    the other tests use) serves children with the opt-out and without, each left by the hook as
    a fresh interpreter with that value is (disarmed, or armed)."""
    base = {name: value for name, value in os.environ.items() if name != "SAFELENS_TL_AUTOPATCH"}
    seen = []
    for value in ("0", None, "0"):
        environment = dict(base) if value is None else {**base, "SAFELENS_TL_AUTOPATCH": value}
        warm = run_python(["-c", HOOK_PROBE], env=environment, timeout=120)
        fresh = subprocess.run(
            [sys.executable, "-c", HOOK_PROBE],
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout), value
        seen.append(warm.stdout.strip())
    assert seen == ['["disabled", false]', '["watching", true]', '["disabled", false]'], seen


def test_a_warm_child_has_torch_imported_and_a_fresh_one_not() -> None:
    """What the module docstring of ``tests/warm_python.py`` says a warm child has in addition."""
    code = "import sys; print('torch' in sys.modules)"
    assert run_python(["-c", code], timeout=120).stdout == "True\n"
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert fresh.stdout == "False\n"
