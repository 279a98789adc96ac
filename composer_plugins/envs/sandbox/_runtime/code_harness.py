"""Runs one HumanEval-format program and its tests inside the sandbox; reports each test.

Reads ``task.json`` from the working directory and deletes it before any untrusted code
runs. The two test styles (``asserts``, ``cases``): docs/envs.md, "``code``". Each record goes
through the nonce-authenticated channel (``_cp_channel``).
"""

import ast
import contextlib
import copy
import json
import math
import os
import signal
import sys
import traceback

from _cp_channel import open_channel


class UnitTimeout(BaseException):
    """Raised by SIGALRM when one test runs past its time limit."""


def _alarm(signum, frame):
    raise UnitTimeout()


def _short(text, limit=600):
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _safe_repr(value, limit=300):
    try:
        return _short(repr(value), limit)
    except BaseException as e:
        return f"<unrepresentable {type(value).__name__}: {type(e).__name__}>"


def _jsonable(value, depth=0):
    """Convert a returned value to JSON the parent can compare, keeping type tags."""
    if depth > 20:
        raise ValueError("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if abs(value) < 2**53 else {"__int__": str(value)}
    if t is float:
        if math.isnan(value) or math.isinf(value):
            return {"__float__": repr(value)}
        return value
    if t is list:
        return [_jsonable(v, depth + 1) for v in value]
    if t is tuple:
        return {"__tuple__": [_jsonable(v, depth + 1) for v in value]}
    if t is dict:
        return {"__dict__": [[_jsonable(k, depth + 1), _jsonable(v, depth + 1)] for k, v in value.items()]}
    if t in (set, frozenset):
        items = [_jsonable(v, depth + 1) for v in value]
        return {"__set__": sorted(items, key=lambda x: json.dumps(x, sort_keys=True))}
    return {"__repr__": _safe_repr(value), "__type__": t.__name__}


def _error_record(exc, filename):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    line = frames[-1].lineno if frames else getattr(exc, "lineno", None)
    return {
        "error": type(exc).__name__,
        "message": _short(exc),
        "lineno": line,
        "traceback": _short("".join(traceback.format_exception_only(type(exc), exc)), 1000),
    }


_PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)


def _plain(x, depth=0):
    """Only built-in values all the way down (no object with a hand-written ``__eq__``)."""
    if depth > 50 or type(x) not in _PLAIN:
        return False
    if type(x) in (list, tuple, set, frozenset):
        return all(_plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in x.items())
    return True


def _cp_eq(actual, expected):
    """``actual == expected`` that a returned object cannot fake with ``__eq__``/``__bool__``."""
    if _plain(expected) and not _plain(actual):
        return False
    return bool(actual == expected) if _plain(actual) else type(actual) is type(expected) and expected == actual


def _cp_true(x):
    return _plain(x) and bool(x)


def _cp_false(x):
    return _plain(x) and not x


class _StrictAsserts(ast.NodeTransformer):
    """Rewrite ``assert f(x) == y``, ``assert f(x)`` and ``assert not f(x)`` to the strict helpers."""

    def visit_Assert(self, node):
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq | ast.NotEq):
            call = ast.Call(ast.Name("_cp_eq", ast.Load()), [t.left, t.comparators[0]], [])
            node.test = call if isinstance(t.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
        elif isinstance(t, ast.Call):
            node.test = ast.Call(ast.Name("_cp_true", ast.Load()), [t], [])
        elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and isinstance(t.operand, ast.Call):
            node.test = ast.Call(ast.Name("_cp_false", ast.Load()), [t.operand], [])
        return ast.copy_location(node, node)


def _has_assert(node):
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _trivial_assert(node):
    return isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant) and bool(node.test.value)


def _timed(timeout, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` with a SIGALRM (:class:`UnitTimeout`) after ``timeout`` seconds."""
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _actual_value(stmt, ns, timeout):
    """For ``assert f(x) == y`` that failed, the value ``f(x)`` returned (for feedback)."""
    t = stmt.test if isinstance(stmt, ast.Assert) else None
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq | ast.Is)):
        return None
    try:
        left = compile(ast.fix_missing_locations(ast.Expression(t.left)), "<test>", "eval")
        value = _timed(timeout, eval, left, ns)
        expected = None
        with contextlib.suppress(BaseException):
            right = compile(ast.fix_missing_locations(ast.Expression(t.comparators[0])), "<test>", "eval")
            expected = _safe_repr(eval(right, ns))
        return {"actual": _safe_repr(value), "expected": expected}
    except BaseException:
        return None


def main():
    send = open_channel()
    with open("task.json", encoding="utf-8") as f:
        spec = json.load(f)
    os.unlink("task.json")
    signal.signal(signal.SIGALRM, _alarm)
    program = spec["program"]
    entry = spec["entry_point"]
    timeout = float(spec.get("per_test_timeout", 3.0))
    mode = spec.get("mode", "asserts")
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    # Parse the tests before any untrusted code runs.
    units = []
    test_src = spec.get("test") or ""
    setup_code = None
    param = "candidate"
    if mode == "asserts":
        tree = ast.parse(test_src, "<test>")
        checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
        rest = [n for n in tree.body if n not in checks]
        if not checks:
            raise SystemExit("test code defines no check(candidate) function")
        check = checks[-1]
        if check.args.args:
            param = check.args.args[0].arg
        setup_code = compile(ast.Module(rest, []), "<test>", "exec")
        for stmt in check.body:
            if _trivial_assert(stmt):
                continue
            src = ast.get_source_segment(test_src, stmt) or ast.unparse(stmt)
            try:
                strict = _StrictAsserts().visit(copy.deepcopy(stmt))
                code = compile(ast.fix_missing_locations(ast.Module([strict], [])), "<test>", "exec")
            except SyntaxError:
                continue
            units.append((_has_assert(stmt), code, stmt, src))
    n_tests = sum(1 for u in units if u[0]) if mode == "asserts" else len(spec.get("cases", []))
    send({"kind": "start", "n": n_tests})
    failed = None
    try:
        _timed(timeout, exec, compile(program, "solution.py", "exec"), ns)
        candidate = ns[entry]
    except UnitTimeout:
        failed = {"error": "Timeout", "message": "defining the solution timed out"}
    except KeyError:
        failed = {"error": "NameError", "message": f"the solution does not define {entry!r}"}
    except BaseException as e:
        failed = _error_record(e, "solution.py")
    if failed is not None:
        send({"kind": "load", "ok": False, **failed})
        send({"kind": "done", "n": n_tests})
        return
    send({"kind": "load", "ok": True})
    if mode == "cases":
        for i, case in enumerate(spec.get("cases", [])):
            args = copy.deepcopy(case.get("args", []))
            kwargs = copy.deepcopy(case.get("kwargs", {}))
            try:
                out = _timed(timeout, candidate, *args, **kwargs)
                send({"kind": "case", "i": i, "ok": True, "output": _jsonable(out)})
            except UnitTimeout:
                send({"kind": "case", "i": i, "ok": False, "error": "Timeout", "message": "timed out"})
            except BaseException as e:
                send({"kind": "case", "i": i, "ok": False, **_error_record(e, "solution.py")})
    else:
        ns[param] = candidate
        ns.update(_cp_eq=_cp_eq, _cp_true=_cp_true, _cp_false=_cp_false)
        try:
            _timed(timeout, exec, setup_code, ns)
        except BaseException as e:
            send({"kind": "setup", "ok": False, **_error_record(e, "<test>")})
        i = 0
        for is_test, code, stmt, src in units:
            try:
                _timed(timeout, exec, code, ns)
                ok, rec = True, {}
            except UnitTimeout:
                ok, rec = False, {"error": "Timeout", "message": f"timed out after {timeout:g}s"}
            except AssertionError as e:
                ok, rec = False, {"error": "AssertionError", "message": _short(e)}
                extra = _actual_value(stmt, ns, timeout)
                if extra:
                    rec.update(extra)
            except BaseException as e:
                ok, rec = False, _error_record(e, "solution.py")
            if is_test:
                send({"kind": "test", "i": i, "ok": ok, "source": _short(src, 400), "lineno": stmt.lineno, **rec})
                i += 1
            elif not ok:
                send({"kind": "setup", "ok": False, "source": _short(src, 400), **rec})
    send({"kind": "done", "n": n_tests})


if __name__ == "__main__":
    main()
    sys.stdout.flush()
