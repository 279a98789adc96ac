"""Shared fixtures: a fresh plugin manager per test, isolation of the process-wide registry, no autoload.

Third-party plugins do not autoload in this suite (``COMPOSER_PLUGINS_LOAD=''``, which the plugin
manager honours; the built-ins always load), so results do not depend on what happens to be installed.
Tests where discovery is the subject turn it back on with the ``discovery`` fixture (or set the
variable themselves, as the entry-point tests in ``tests/core/test_core_plugins.py`` do).

Also a safety net for tests that start processes: every process started while a fixture sets up or
while a test runs carries a tag in its environment (inherited by its own children, even those in
sessions of their own), and whatever is still alive once that fixture is torn down, or once the test
and its function-scoped fixtures are, is SIGKILLed and reported as a :class:`LeftoverProcessWarning`.
So a failing or timed-out test (pytest-timeout bounds every test; see ``pyproject.toml``) cannot leave
servers or workers behind; the tests still clean up after themselves (``finally``), this only catches
what they miss.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pytest

from composer_plugins import procs
from composer_plugins.core import plugins

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ[plugins.LOAD_ENV] = ""  # no third-party autoload: built-ins only, whatever is installed

# ``fresh_pm``: a plugin manager with the built-in plugins only; plugin authors import the same fixture
from composer_plugins.testing import fresh_pm  # noqa: F401


@pytest.fixture
def discovery(monkeypatch):
    """Entry-point discovery on (installed third-party plugins load) for a test whose subject it is."""
    monkeypatch.delenv(plugins.LOAD_ENV, raising=False)
    plugins.reset()
    yield plugins
    plugins.reset()


@pytest.fixture
def isolated_plugins():
    """Reset the process-wide plugin manager before and after a test that changes it."""
    from composer_plugins.core import plugins

    plugins.reset()
    yield plugins
    plugins.reset()


# -- no process outlives the test or fixture that started it -------------------------------------


class LeftoverProcessWarning(UserWarning):
    """A test or fixture left processes running; they were killed."""


#: Helpers a library loaded into the test process starts for that process's whole life, which kill the
#: process when they die: OpenMPI's singleton daemon (``orted ... --singleton-died-pipe``; an MPI-linked
#: import on a GPU image starts it, and once it is killed the test process exits with status 195 at its
#: next MPI call, taking the whole run with it). Never a test's leftover.
_PROCESS_DAEMON_MARKERS = ("--singleton-died-pipe",)


def _own_daemons(pids: list[int]) -> list[int]:
    me = os.getpid()
    out = []
    for pid in pids:
        info = procs.proc_info(pid)
        if info is not None and info.ppid == me and any(m in info.cmdline for m in _PROCESS_DAEMON_MARKERS):
            out.append(pid)
    return out


class _Sweep:
    """Tags processes started from now on (through the environment) and kills the tagged ones later."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.tag = procs.new_tag("pytest")
        self.before = set(procs.all_pids())

    def activate(self) -> str | None:
        old = os.environ.get(procs.TAG_ENV)
        os.environ[procs.TAG_ENV] = procs.tag_env(self.tag)[procs.TAG_ENV]
        return old

    @staticmethod
    def restore(old: str | None) -> None:
        if old is None:
            os.environ.pop(procs.TAG_ENV, None)
        else:
            os.environ[procs.TAG_ENV] = old

    def finish(self) -> None:
        new = [p for p in procs.all_pids() if p not in self.before]
        left = procs.tagged_pids(self.tag, among=new)
        spare = _own_daemons(left)
        left = [p for p in left if p not in spare]
        if not left:
            return
        lines = procs.describe(left)
        procs.kill_tree(tag=self.tag, spare=spare)
        if lines:
            msg = f"{self.what} left {len(lines)} process(es) running; killed:\n  " + "\n  ".join(lines)
            warnings.warn(LeftoverProcessWarning(msg), stacklevel=1)


_fixture_sweeps: dict[int, _Sweep] = {}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
    sweep = _Sweep(f"fixture {fixturedef.argname!r}")
    _fixture_sweeps[id(fixturedef)] = sweep
    old = sweep.activate()
    try:
        return (yield)
    finally:
        sweep.restore(old)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
    # runs after the fixture's own teardown
    sweep = _fixture_sweeps.pop(id(fixturedef), None)
    if sweep is not None:
        sweep.finish()


_test_sweep = pytest.StashKey[_Sweep]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    sweep = item.stash[_test_sweep] = _Sweep(f"test {item.nodeid}")
    old = sweep.activate()
    try:
        return (yield)
    finally:
        sweep.restore(old)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)  # the test's function-scoped fixtures are torn down in here
    finally:
        sweep = item.stash.get(_test_sweep, None)
        if sweep is not None:
            sweep.finish()
