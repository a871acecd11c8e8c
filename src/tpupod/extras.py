"""The optional packages each extra brings, and the one check every command makes before
any work: a command whose extra is not installed ends at once with

    error: 'tpupod serve up' needs the serve extra (not installed: aiohttp)
    hint: pip install 'tpupod[serve]'

on the launcher (``require``, called by the CLI's ``command`` registration and the fast
paths) and on each worker: a worker's tpupod process is started as
``python -m tpupod.extras EXTRA MODULE ARGS...`` (``worker_argv``), which checks the
extra where it runs, then runs the module. An import that fails later anyway (a module
the table does not list) is named the same way by ``for_missing_module``.

A light module: ``importlib.util.find_spec`` finds a package without importing it, so the
check costs the fast paths well under a millisecond.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

from tpupod.errors import MissingExtra

# What `import` each extra makes possible (pyproject.toml's lists, by import name). The
# order also says which extra a module names first when several bring it (fastapi).
EXTRAS: dict[str, tuple[str, ...]] = {
    "jax": ("jax",),
    "model": ("jax", "flax", "numpy", "safetensors", "tokenizers", "jinja2", "fsspec"),
    "serve": (
        "fastapi",
        "uvicorn",
        "httptools",
        "uvloop",
        "httpx",
        "prometheus_client",
        "aiohttp",
    ),
    "jobs": ("sqlalchemy", "fastapi", "uvicorn", "httpx"),
    "dashboard": ("fastapi", "uvicorn", "jinja2", "sqlalchemy", "httpx", "prometheus_client"),
    "checkpoint-bench": ("jax", "numpy", "orbax.checkpoint", "matplotlib", "fsspec"),
    "gcp": ("google.cloud.tpu_v2", "google.api_core"),
    "sgl": ("sglang_router",),
}
# Packages the extras pull in that a traceback may name instead of the listed ones.
PULLED_IN = {"flax": "model", "orbax": "checkpoint-bench", "psycopg": "jobs", "kubernetes": "jobs"}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` this Python cannot import (none: the extra is installed)."""
    return [module for module in EXTRAS[extra] if not _findable(module)]


def require(subject: str, *extras: str, where: str = "") -> None:
    """Raise :class:`MissingExtra` for the first of ``extras`` that is not installed;
    ``subject`` is what needs them (``'tpupod serve up'``)."""
    for extra in extras:
        absent = missing(extra)
        if absent:
            raise MissingExtra(subject, extra, absent, where=where)


def exit_unless_installed(subject: str, *extras: str) -> None:
    """End this process with ``require``'s two lines and exit 1 when one of ``extras`` is
    missing: on a worker, before its tpupod module runs (``python -m tpupod.extras``) or
    where a user's program first calls tpupod (``tpupod.init_jax()``), where a traceback
    would bury the one thing to do."""
    try:
        require(subject, *extras, where=" on this worker")
    except MissingExtra as exc:
        sys.stdout.flush()
        sys.exit(f"error: {exc.message}\nhint: {exc.hint}")


def for_missing_module(exc: BaseException, subject: str) -> MissingExtra | None:
    """The extra a failed import belongs to, as the error ``require`` would have raised."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    for extra, modules in EXTRAS.items():
        if any(m == exc.name or m.split(".")[0] == top for m in modules):
            return MissingExtra(subject, extra, [exc.name])
    pulled_in = PULLED_IN.get(top)
    return MissingExtra(subject, pulled_in, [exc.name]) if pulled_in else None


def worker_argv(python: str, extras: str, module: str, *args: str) -> list[str]:
    """The command line that runs ``python -m module args`` on a worker once its Python is
    known to have ``extras`` (comma-separated; else one error line there, and exit 1)."""
    return [python, "-m", "tpupod.extras", extras, module, *args]


def _findable(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or blocked
        return False


def _run_on_worker(argv: list[str]) -> int:
    """``python -m tpupod.extras EXTRAS MODULE ARGS...``: check, then run MODULE as __main__."""
    # a worker's only: every command's start imports this module
    import runpy

    extras, module, *args = argv
    exit_unless_installed(_label(module), *extras.split(","))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _label(module: str) -> str:
    """The command a worker module serves, as a user typed it (``'tpupod serve'``)."""
    parts = module.split(".")
    return "'" + " ".join(["tpupod", *parts[1:2]]) + "'"


if __name__ == "__main__":
    sys.exit(_run_on_worker(sys.argv[1:]))
