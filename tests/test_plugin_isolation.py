"""Broken third-party plugins are reported and skipped; the built-in fix stays active.
Start-up safety: the hook reads one variable and loads plugins only from installed distributions.

The plugins are REAL installed distributions: a temporary site folder holds, for each, a
``<name>-0.1.dist-info`` (``METADATA`` + ``entry_points.txt`` in the ``safelens_tl`` group) and its
module. A fresh interpreter with that folder on ``PYTHONPATH`` finds them through
``importlib.metadata`` exactly as it would find a ``pip install``-ed plugin, then imports
``transformer_lens`` (the start-up hook activates there when installed) and asks for the report.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import safelens_tl
from safelens_tl import _import_hooks, _startup
from tests.conftest import RELEASE

pytestmark = pytest.mark.release_independent

#: module name -> (source, what went wrong), one faulty distribution each.
FAULTY_PLUGINS: dict[str, tuple[str, str]] = {
    "sl_import_fails": (
        "raise RuntimeError('sl_import_fails: broken at import')\n",
        "load",
    ),
    "sl_hook_raises": (
        "from safelens_tl.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def safelens_tl_patches(layout):\n"
        "    raise ValueError('sl_hook_raises: broken inside the hook')\n",
        "safelens_tl_patches",
    ),
    "sl_malformed": (
        "from safelens_tl.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def safelens_tl_patches(layout):\n"
        "    return ['not a Patch', 42]\n",
        "safelens_tl_patches",
    ),
    "sl_not_iterable": (
        "from safelens_tl.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def safelens_tl_patches(layout):\n"
        "    return 42\n",
        "safelens_tl_patches",
    ),
    "sl_exits_at_import": (
        "raise SystemExit('sl_exits_at_import: an argparse at import, say')\n",
        "load",
    ),
    "sl_exits_in_hook": (
        "from safelens_tl.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def safelens_tl_patches(layout):\n"
        "    raise SystemExit(3)\n",
        "safelens_tl_patches",
    ),
    "sl_conflicting": (
        "from safelens_tl.hookspecs import hookimpl\n"
        "from safelens_tl.patching import Patch\n"
        "def hijacked_append(self, new_keys, new_values):\n"
        "    raise AssertionError('the conflicting plugin replaced the built-in append')\n"
        "@hookimpl\n"
        "def safelens_tl_patches(layout):\n"
        "    return [Patch(layout.entry_class, 'append', hijacked_append)]\n",
        "install",
    ),
}

CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import transformer_lens  # the start-up hook, when installed, activates here
        import safelens_tl
        report = safelens_tl.activate()  # idempotent: the hook's report, or a first activation
    from safelens_tl import targets
    from safelens_tl.kv import entry as kv_cache
    entry_class = targets.locate().entry_class
    cfg = type("Cfg", (), {"n_heads": 2, "d_head": 4, "dtype": "float32", "n_ctx": 8})()
    entry = entry_class.init_cache_entry(cfg, "cpu", 1)
    keys, values = entry.append(torch.ones(1, 1, 2, 4, dtype=torch.float16),
                                torch.ones(1, 1, 2, 4, dtype=torch.float16))
    print(json.dumps({
        "report": report.to_dict(),
        "warnings": [str(w.message) for w in caught if "safelens" in str(w.message)],
        "append_is_builtin": entry_class.__dict__["append"] is kv_cache.append,
        "fp16_append_dtype": str(keys.dtype),
        "transformer_lens_file": transformer_lens.__file__,
        "stray_imported": "sl_stray" in sys.modules,
        "thread_import_finished": __import__("sl_thread_import").FINISHED,
    }))
    """
)


def write_distribution(site: Path, name: str, module_source: str, entry_points: str) -> None:
    """Install a distribution by hand: ``<name>-0.1.dist-info`` and its module ``<name>.py``."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)
    (site / f"{name}.py").write_text(module_source)


def run_child(site: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter whose ``PYTHONPATH`` starts with ``site``."""
    environment = {**os.environ, "PYTHONPATH": str(site), **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300
    )


@pytest.fixture(scope="module")
def child_result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One interpreter with every faulty plugin installed at once."""
    site = tmp_path_factory.mktemp("site")
    for name, (source, _) in FAULTY_PLUGINS.items():
        write_distribution(site, name, source, f"[safelens_tl]\n{name} = {name}\n")
    # A module that implements the hook but is no installed distribution, named in a made-up
    # variable: start-up safety says neither makes it a plugin.
    (site / "sl_stray.py").write_text(FAULTY_PLUGINS["sl_hook_raises"][0])
    write_distribution(
        site,
        "sl_thread_import",
        THREAD_IMPORT,
        "[safelens_tl]\nsl_thread_import = sl_thread_import\n",
    )
    done = run_child(site, CHILD, SAFELENS_TL_PLUGINS="sl_stray", SAFELENS_TL_PLUGIN="sl_stray")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


#: A well-behaved plugin except that it waits for a worker thread importing TransformerLens,
#: which would wait for the import lock the importing thread holds while plugins run.
THREAD_IMPORT = """
import threading
from safelens_tl.hookspecs import hookimpl
FINISHED = []

def _worker():
    import transformer_lens
    FINISHED.append(transformer_lens.__name__)

@hookimpl
def safelens_tl_patches(layout):
    worker = threading.Thread(target=_worker)
    worker.start()
    worker.join(60)
    if worker.is_alive():
        raise RuntimeError("sl_thread_import: the worker's import is still blocked after 60 s")
    return []
"""


def test_a_plugin_may_wait_for_a_thread_that_imports_transformer_lens(
    child_result: dict[str, Any],
) -> None:
    assert child_result["thread_import_finished"] == ["transformer_lens"]
    sources = {f["source"] for f in child_result["report"]["failures"]}
    assert "sl_thread_import:sl_thread_import" not in sources


def test_each_failure_is_printed_once_not_also_by_logging(child_result: dict[str, Any]) -> None:
    """The child records the warnings; nothing about the failures may reach stderr besides."""
    assert "sl_hook_raises: broken inside the hook" not in child_result["stderr"]


def test_a_plugin_that_hangs_is_named_on_stderr_while_it_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_distribution(
        site,
        "sl_sleeps",
        "import time\ntime.sleep(3)\n",
        "[safelens_tl]\nsl_sleeps = sl_sleeps\n",
    )
    code = (
        "from safelens_tl import plugins\n"
        "plugins.SLOW_PLUGIN_SECONDS = 0.5\n"
        "import transformer_lens, safelens_tl\n"
        "safelens_tl.activate()\n"
        "print(safelens_tl.is_active())\n"
    )
    done = run_child(site, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
    assert "plugin sl_sleeps:sl_sleeps (load) has not returned after" in done.stderr


@pytest.mark.parametrize("name", sorted(FAULTY_PLUGINS))
def test_each_fault_is_a_warning_and_a_status_entry(
    child_result: dict[str, Any], name: str
) -> None:
    """Every faulty distribution appears in status() at the right stage and in a warning."""
    stage = FAULTY_PLUGINS[name][1]
    source = f"{name}:{name}"  # "<distribution>:<entry point>"
    failures = [f for f in child_result["report"]["failures"] if f["source"] == source]
    assert [f["stage"] for f in failures] == [stage], child_result["report"]["failures"]
    assert any(source in warning for warning in child_result["warnings"]), child_result["warnings"]


def test_builtin_fix_stays_active(child_result: dict[str, Any]) -> None:
    """The built-in plugin's patches are all installed, and it is the built-in append that runs."""
    report = child_result["report"]
    assert report["active"] is True
    assert report["transformer_lens"] == RELEASE
    assert any(p.endswith(".append") for p in report["patched"])
    assert any(p.endswith(".init_cache_entry") for p in report["patched"])
    assert child_result["append_is_builtin"] is True
    assert child_result["fp16_append_dtype"] == "torch.float16"
    assert "safelens-tl:kv_cache" in report["plugins"]


def test_transformer_lens_imports_from_its_real_location(child_result: dict[str, Any]) -> None:
    """TL was imported (not shadowed by the temporary site folder) and the child exited cleanly."""
    assert "site-packages" in child_result["transformer_lens_file"]


def test_only_installed_distributions_become_plugins(child_result: dict[str, Any]) -> None:
    """A hook-implementing module on sys.path, named in env variables, is never imported."""
    assert child_result["stray_imported"] is False
    assert not any("sl_stray" in name for name in child_result["report"]["plugins"])


# Start-up safety ---------------------------------------------------------------------------------

PACKAGE = Path(safelens_tl.__file__).resolve().parent
#: Modules that run inside every process that imports transformer_lens (the automatic path).
AUTOMATIC_PATH = sorted(
    path
    for path in PACKAGE.rglob("*.py")
    if path.name != "__main__.py" and path.relative_to(PACKAGE).parts[0] not in {"cli", "verify"}
)
#: What the start-up modules may import at all (module level or inside functions).
STARTUP_IMPORTS = {
    "__future__",
    "_thread",  # built into the interpreter: a lock for the import watcher, no start-up cost
    "os",
    "sys",
    "safelens_tl",
    "safelens_tl._import_hooks",
    "safelens_tl.activation",
    "safelens_tl.plugins",
    "warnings",
    "collections.abc",
    "importlib.machinery",
    "types",
}
FORBIDDEN_CALLS = {
    "eval",
    "exec",
    "compile",
    "__import__",
    "import_module",
    "system",
    "popen",
    "spawnl",
    "execv",
    "run_path",
    "run_module",
    "load_setuptools_entrypoints",
}


def _environment_reads(tree: ast.AST) -> list[ast.AST]:
    """Every node that touches os.environ / os.getenv / os.putenv."""
    return [
        node
        for node in ast.walk(tree)
        if (
            isinstance(node, ast.Attribute)
            and node.attr in {"environ", "getenv", "putenv", "environb", "getenvb"}
        )
        or (isinstance(node, ast.Name) and node.id in {"environ", "getenv"})
    ]


def test_startup_hook_reads_only_its_two_variables() -> None:
    """_startup.py reads the environment in exactly two ways: SAFELENS_TL_AUTOPATCH via ENV_VAR
    and SAFELENS_TL_DISABLE via DISABLE_VAR (a string handed to activation, which only compares
    its names with the fixes' ids)."""
    tree = ast.parse(Path(_startup.__file__).read_text(encoding="utf-8"))
    assert _startup.ENV_VAR == "SAFELENS_TL_AUTOPATCH"
    assert _startup.DISABLE_VAR == "SAFELENS_TL_DISABLE"
    reads = _environment_reads(tree)
    assert reads, "expected the opt-out to be read from os.environ"
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in reads:
        # Allowed shape: os.environ.get(ENV_VAR or DISABLE_VAR[, default]) and nothing else.
        method = parents.get(node)
        call = parents.get(method) if method is not None else None
        assert isinstance(method, ast.Attribute) and method.attr == "get", ast.unparse(
            parents[node]
        )
        assert isinstance(call, ast.Call) and call.args, ast.unparse(method)
        key = call.args[0]
        assert (isinstance(key, ast.Name) and key.id in {"ENV_VAR", "DISABLE_VAR"}) or (
            isinstance(key, ast.Constant) and key.value in {_startup.ENV_VAR, _startup.DISABLE_VAR}
        ), ast.unparse(call)


def _called_name(call: ast.Call) -> str:
    """The bare name a call uses: ``f`` for ``f(...)``, ``attr`` for ``obj.attr(...)``."""
    function = call.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def test_startup_hook_executes_nothing_from_the_environment() -> None:
    """No eval/exec/dynamic import in _startup.py and its import watcher; every import names a
    fixed, expected module."""
    for module in (_startup, _import_hooks):
        tree = ast.parse(Path(str(module.__file__)).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                assert _called_name(node) not in FORBIDDEN_CALLS, ast.unparse(node)
            if isinstance(node, ast.Import):
                assert {alias.name for alias in node.names} <= STARTUP_IMPORTS, ast.unparse(node)
            if isinstance(node, ast.ImportFrom):
                assert node.module in STARTUP_IMPORTS, ast.unparse(node)
    pth = (PACKAGE.parent / "safelens_tl.pth").read_text(encoding="utf-8").strip()
    # One line (site runs lines that start with "import"); the exec'd code is a constant that
    # imports the start-up module by its fixed name and is silent only when safelens_tl is gone.
    assert pth.count("\n") == 0 and pth.startswith('import sys; exec("') and pth.endswith('")')
    code = ast.literal_eval(pth.removeprefix("import sys; exec(").removesuffix(")"))
    tree = ast.parse(code)
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import)]
    assert [alias.name for n in imports for alias in n.names] == ["safelens_tl._startup"]
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert calls == {"s.install"}, calls


def test_automatic_path_reads_no_other_variable_and_finds_plugins_only_by_entry_points() -> None:
    """Beyond _startup.py, no module on the automatic path reads the environment; plugins come
    only from importlib.metadata entry points of the safelens_tl group."""
    for path in AUTOMATIC_PATH:
        if path.name == "_startup.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not _environment_reads(tree), f"{path.name} reads the environment"
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _called_name(node)
                # import_module is allowed in targets.py only: it imports the table's fixed paths.
                allowed = {"import_module"} if path.name == "targets.py" else set()
                assert name not in FORBIDDEN_CALLS - allowed, f"{path.name}: {ast.unparse(node)}"
    plugins_source = (PACKAGE / "plugins.py").read_text(encoding="utf-8")
    assert "entry_points(group=hookspecs.ENTRY_POINT_GROUP)" in plugins_source


def test_hostile_opt_out_value_is_only_compared(tmp_path: Path) -> None:
    """A value crafted as code is never run: it is just "not an off value", so the hook arms."""
    marker = tmp_path / "pwned"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    code = "import safelens_tl._startup as s, sys; print(s.state, 'torch' in sys.modules)"
    done = run_child(tmp_path, code, SAFELENS_TL_AUTOPATCH=payload)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert done.stdout.split() == [_startup.WATCHING, "False"]
