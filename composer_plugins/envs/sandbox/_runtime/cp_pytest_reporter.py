"""pytest plugin run inside the sandbox (``-p cp_pytest_reporter``): reports each test outcome.

Loaded before the repository's code is imported, it opens the result channel, snapshots the
pytest machinery that decides outcomes and, before every test and at the end of the session,
checks that nothing replaced it (else it reports tampering: docs/envs.md, "``feature_deletion``").
"""

import builtins
import sys

import _pytest.python
import _pytest.reports
import _pytest.runner
import pytest
from _cp_channel import open_channel

_send = open_channel()

_WATCHED = [
    (_pytest.python.Function, "runtest"),
    (_pytest.python.Function, "setup"),
    (_pytest.runner, "call_and_report"),
    (_pytest.runner, "call_runtest_hook"),
    (_pytest.runner, "check_interactive_exception"),
    (_pytest.runner, "runtestprotocol"),
    (_pytest.runner.CallInfo, "from_call"),
    (_pytest.reports.TestReport, "from_item_and_call"),
    (_pytest.python, "pytest_pyfunc_call"),
    (builtins, "__import__"),
]


def _raw(owner, name):
    d = getattr(owner, "__dict__", {})
    return d[name] if name in d else getattr(owner, name, None)


_SNAPSHOT = [(owner, name, _raw(owner, name)) for owner, name in _WATCHED if hasattr(owner, name)]
_META_PATH = list(sys.meta_path)
_REPORTED = set()


def _tampered():
    """Names of the outcome machinery that was replaced since start-up."""
    bad = [f"{getattr(o, '__name__', o)}.{n}" for o, n, v in _SNAPSHOT if _raw(o, n) is not v]
    if sys.gettrace() is not None:
        bad.append("sys.settrace")
    if sys.getprofile() is not None:
        bad.append("sys.setprofile")
    if [m for m in sys.meta_path if m not in _META_PATH and type(m).__module__ != "_pytest.assertion.rewrite"]:
        bad.append("sys.meta_path")
    return bad


def _message(report):
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    crash = getattr(longrepr, "reprcrash", None)
    text = f"{crash.message}" if crash is not None else str(longrepr)
    return text[-1500:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    bad = _tampered()
    if bad:
        _send({"kind": "tamper", "nodeid": item.nodeid, "what": bad})
    return (yield)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        if report.nodeid in _REPORTED:
            return
        _REPORTED.add(report.nodeid)
        outcome = report.outcome if report.when == "call" else ("error" if report.failed else report.outcome)
        _send({"kind": "test", "nodeid": report.nodeid, "outcome": outcome, "message": _message(report)})
    elif report.when == "teardown" and report.failed and report.nodeid not in _REPORTED:
        _REPORTED.add(report.nodeid)
        _send({"kind": "test", "nodeid": report.nodeid, "outcome": "error", "message": _message(report)})


def pytest_collectreport(report):
    if report.failed:
        _send({"kind": "collect_error", "nodeid": report.nodeid, "message": str(report.longrepr)[-3000:]})


def pytest_sessionfinish(session, exitstatus):
    bad = _tampered()
    if bad:
        _send({"kind": "tamper", "nodeid": "<session>", "what": bad})
    _send({"kind": "done", "exitstatus": int(exitstatus), "reported": len(_REPORTED)})
