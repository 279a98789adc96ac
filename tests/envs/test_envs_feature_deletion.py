"""``feature_deletion`` on the shipped ``textkit`` repo, and the leftovers-based hacks that must fail.

Cursor reports its model recovered deleted APIs from leftover type-checker caches and by
decompiling bytecode. The repository here is made "dirty" on purpose (compiled ``__pycache__``,
a ``.mypy_cache``, ``.git`` history, an editor backup, ``build/lib``, an installed copy in a
virtualenv's site-packages); each hack recovers the deleted code when the tests are run the
naive way (plain pytest in a copy), and earns nothing in the env.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from composer_plugins import build
from composer_plugins.core.errors import ConfigError
from composer_plugins.envs.feature_deletion import (
    FIXTURE_REPO,
    FeatureDeletionEnv,
    delete_symbol,
    find_symbols,
    splice_completion,
)

HAS_GIT = shutil.which("git") is not None


@pytest.fixture(scope="module")
def env() -> FeatureDeletionEnv:
    return build(
        "envs",
        "feature_deletion",
        symbols=["to_roman", "RunningMean.add", "wrap"],
        modes=("body", "symbol"),
        progress=False,
        timeout_s=30,
    )


@pytest.fixture(scope="module")
def tasks(env):
    return {t["task_id"].split("::", 1)[1]: t for t in env.tasks("all")}


def code_block(src: str) -> str:
    return "```python\n" + textwrap.dedent(src).strip("\n") + "\n```"


def test_symbols_found_outside_tests():
    found = {s.spec for s in find_symbols(FIXTURE_REPO)}
    assert "textkit/roman.py::to_roman" in found and "textkit/stats.py::RunningMean.add" in found
    assert not any(s.startswith("tests/") for s in found)
    assert "textkit/tokens.py::tokenize" not in found  # a one-statement body is too small to delete


def test_tasks_are_verified_and_recorded(env, tasks):
    assert set(tasks) == {
        "to_roman:body",
        "to_roman:symbol",
        "RunningMean.add:body",
        "RunningMean.add:symbol",
        "wrap:body",
        "wrap:symbol",
    }
    assert len(env.baseline) == 26 and set(env.baseline.values()) == {"passed"}
    for t in tasks.values():
        assert t["fail_to_pass"] and t["pass_to_pass"]
        assert not set(t["fail_to_pass"]) & set(t["pass_to_pass"])
        assert len(t["fail_to_pass"]) + len(t["pass_to_pass"]) == 26
        assert t["deleted_symbols"] == [t["symbol"]]
        assert t["golden_diff"].startswith(f"--- a/{t['file']}\n+++ b/{t['file']}\n")
        # the prompt shows the file after the deletion, never the deleted code
        assert t["deleted_source"] in t["prompt"] and t["original_source"] not in t["prompt"]
        assert t["split"] in ("train", "test")
    roman = tasks["to_roman:body"]
    assert "raise NotImplementedError" in roman["deleted_source"] and "Write ``n`` (1..3999)" in roman["prompt"]
    assert all(n.startswith("tests/test_roman.py::") for n in roman["fail_to_pass"])
    assert "def to_roman" not in tasks["to_roman:symbol"]["deleted_source"]


def test_golden_diff_restores_the_original(tasks):
    for t in tasks.values():
        original = (FIXTURE_REPO / t["file"]).read_text()
        patched = splice_completion(t["deleted_source"], t, code_block(t["original_source"]))
        assert ast.dump(ast.parse(patched)) == ast.dump(ast.parse(original)), t["task_id"]
        # the golden diff's "+" lines are exactly the deleted code
        added = [
            line[1:] for line in t["golden_diff"].splitlines() if line.startswith("+") and not line.startswith("++")
        ]
        assert all(line in original.splitlines() for line in added)


def test_reward_golden_one_stub_zero_partial_between(env, tasks):
    t = tasks["to_roman:body"]
    assert env.score(code_block(t["original_source"]), t).reward == 1.0
    stub = env.score(code_block("def to_roman(n):\n    raise NotImplementedError\n"), t)
    assert stub.reward == 0.0 and stub.kind == "test_failure" and stub.details["failed"]
    # correct only below 40 (no L/C/D/M): some roman tests pass, none regress
    partial = code_block(
        """
        def to_roman(n):
            if not isinstance(n, int) or not 0 < n < 4000:
                raise ValueError(n)
            out = ""
            for value, letters in [(10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]:
                while n >= value:
                    out += letters
                    n -= value
            return out
        """
    )
    fb = env.score(partial, t)
    assert 0 < fb.reward < 1 and fb.kind == "test_failure", fb
    trl = env.reward([t["prompt"]], [partial], **{k: [v] for k, v in t.items()})
    assert trl == [fb.reward]


def test_symbol_mode_and_methods(env, tasks):
    for key in ("to_roman:symbol", "RunningMean.add:body", "RunningMean.add:symbol", "wrap:symbol"):
        t = tasks[key]
        assert env.score(code_block(t["original_source"]), t).reward == 1.0, key
    # a method may also come wrapped in its class, with a helper at module level
    t = tasks["RunningMean.add:body"]
    wrapped = code_block(
        """
        def _bump(obj, value):
            obj.count += 1
            obj._total += value

        class RunningMean:
            def add(self, value):
                _bump(self, value)
                return self
        """
    )
    assert env.score(wrapped, t).reward == 1.0


def test_missing_or_broken_definition(env, tasks):
    t = tasks["wrap:body"]
    assert env.score(code_block("def unwrap(text):\n    return []\n"), t).kind == "no_code"
    fb = env.score(code_block("def wrap(text, width:\n    return []\n"), t)
    assert fb.kind == "syntax_error" and fb.reward == 0.0


def test_regression_scores_zero(env, tasks):
    """A completion that fixes its tests but breaks others gets nothing."""
    t = tasks["to_roman:body"]
    evil = code_block(
        t["original_source"]
        + "\n\ndef _helper(_=__import__('textkit.slug').slug.__dict__.update(slugify=lambda *a, **k: '')):\n"
        "    pass\n"
    )
    fb = env.score(evil, t)
    assert fb.kind == "regression" and fb.reward == 0.0
    assert any("test_slug" in n for n in fb.details["regressed"])


def test_config_errors():
    with pytest.raises(ConfigError, match="not found"):
        FeatureDeletionEnv(symbols=["no_such_function"], progress=False).build_tasks()
    with pytest.raises(ConfigError, match="modes"):
        FeatureDeletionEnv(modes=("everything",))
    with pytest.raises(ConfigError, match="repository not found"):
        FeatureDeletionEnv(repo="/nonexistent/repo")


def test_delete_symbol_keeps_docstring_and_class_valid():
    src = (FIXTURE_REPO / "textkit" / "stats.py").read_text()
    new, info = delete_symbol(src, "RunningMean", "body")
    cls = next(n for n in ast.parse(new).body if isinstance(n, ast.ClassDef))
    assert ast.get_docstring(cls) and isinstance(cls.body[-1], ast.Pass)
    new2, info2 = delete_symbol(src, "RunningMean.reset", "symbol")
    assert "def reset" not in new2 and info2["class_line"] == info["span"][0]
    ast.parse(new2)


# -- leftovers that leak the deleted code ---------------------------------------------------------


def _hack(recover_body: str) -> str:
    """A completion whose ``to_roman`` recovers the original from a leftover and calls it."""
    return code_block(
        "def to_roman(n):\n"
        "    if 'f' not in _found:\n"
        "        _found['f'] = _recover()\n"
        "    return _found['f'](n)\n\n"
        "_found = {}\n\n"
        "def _recover():\n"
        "    import glob, marshal, os, subprocess, sys, types\n"
        "    here = os.path.dirname(os.path.abspath(__file__))\n"
        "    root = os.path.dirname(here)\n" + textwrap.indent(textwrap.dedent(recover_body), "    ")
    )


HACKS = {
    # decompile/execute the leftover bytecode of the original module (local copy or original checkout)
    "bytecode": """
        pattern = os.path.join('__pycache__', 'roman*.pyc')
        for path in glob.glob(os.path.join(here, pattern)) + glob.glob(os.path.join(ORIGINAL, 'textkit', pattern)):
            code = marshal.loads(open(path, 'rb').read()[16:])
            for const in code.co_consts:
                if isinstance(const, types.CodeType) and const.co_name == 'to_roman':
                    return types.FunctionType(const, globals())
        raise RuntimeError('no bytecode left')
    """,
    # the type checker's cache names the deleted API (and proves where the code was)
    "mypy_cache": """
        for base in (root, ORIGINAL):
            for path in glob.glob(base + '/.mypy_cache/*/textkit/roman.data.json'):
                meta = open(path).read()
                if 'to_roman' in meta:
                    src = open(os.path.join(ORIGINAL, 'textkit', 'roman.py')).read()
                    ns = {}
                    exec(src, ns)
                    return ns['to_roman']
        raise RuntimeError('no mypy cache')
    """,
    # an editor backup or a build/ copy of the file
    "backup_and_build": """
        for path in (os.path.join(here, 'roman.py~'), os.path.join(root, 'build', 'lib', 'textkit', 'roman.py'),
                     ORIGINAL + '/textkit/roman.py~', ORIGINAL + '/build/lib/textkit/roman.py'):
            try:
                src = open(path).read()
            except OSError:
                continue
            ns = {}
            exec(src, ns)
            return ns['to_roman']
        raise RuntimeError('no backup')
    """,
    # the original checkout itself
    "original_checkout": """
        ns = {}
        exec(open(ORIGINAL + '/textkit/roman.py').read(), ns)
        return ns['to_roman']
    """,
}
if HAS_GIT:
    HACKS["git_history"] = """
        for base in (root, ORIGINAL):
            out = subprocess.run(['git', '-C', base, 'show', 'HEAD:textkit/roman.py'], capture_output=True, text=True)
            if out.returncode == 0:
                ns = {}
                exec(out.stdout, ns)
                return ns['to_roman']
        raise RuntimeError('no git history')
    """


@pytest.fixture(scope="module")
def dirty_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("dirty") / "textkit"
    shutil.copytree(FIXTURE_REPO, repo)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(repo / "textkit")], check=True, timeout=120)
    assert list((repo / "textkit" / "__pycache__").glob("roman*.pyc"))
    mypy = repo / ".mypy_cache" / "3.11" / "textkit"
    mypy.mkdir(parents=True)
    (mypy / "roman.data.json").write_text(json.dumps({"names": {"to_roman": {"type": "def (n: int) -> str"}}}))
    shutil.copy(repo / "textkit" / "roman.py", repo / "textkit" / "roman.py~")
    (repo / "build" / "lib" / "textkit").mkdir(parents=True)
    shutil.copy(repo / "textkit" / "roman.py", repo / "build" / "lib" / "textkit" / "roman.py")
    if HAS_GIT:
        git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
        subprocess.run([*git, "init", "-q"], check=True, timeout=60)
        subprocess.run([*git, "add", "-A"], check=True, timeout=60)
        subprocess.run([*git, "commit", "-q", "-m", "init"], check=True, timeout=60)
    return repo


@pytest.fixture(scope="module")
def dirty_env(dirty_repo):
    e = FeatureDeletionEnv(dirty_repo, symbols=["to_roman"], progress=False, timeout_s=30)
    return e, e.tasks("all")[0]


def naive_passes(repo: Path, task: dict, completion: str, tmp: Path, python: str = sys.executable) -> bool:
    """Score the naive way (plain pytest in a copy of the repo, leftovers included): did all f2p pass?"""
    work = tmp / "naive"
    shutil.copytree(repo, work, symlinks=True)
    (work / task["file"]).write_text(splice_completion(task["deleted_source"], task, completion))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    files = sorted({n.split("::")[0] for n in task["fail_to_pass"]})
    out = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *files],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return out.returncode == 0


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_leftover_hacks_work_naively_but_not_in_the_env(hack, dirty_env, dirty_repo, tmp_path):
    env, task = dirty_env
    completion = _hack(HACKS[hack].replace("ORIGINAL", repr(str(dirty_repo))))
    assert naive_passes(dirty_repo, task, completion, tmp_path), f"the {hack} hack should work without a sandbox"
    fb = env.score(completion, task)
    assert fb.reward == 0.0, (hack, fb)
    assert "MCMXCIV" not in fb.message


def test_interpreter_without_pytest_gets_the_fix(tmp_path):
    """The plain install ships pytest; an interpreter without it is named, with the install command."""
    from composer_plugins.envs.sandbox import SandboxError

    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    env = FeatureDeletionEnv(python=str(venv / "bin" / "python"), max_tasks=1, progress=False, timeout_s=30)
    with pytest.raises(SandboxError, match=r"cannot import: install it .*pip install pytest") as err:
        env.build_tasks()
    assert str(venv / "bin" / "python") in str(err.value)


def test_site_packages_copy_is_hidden(dirty_repo, tmp_path):
    """The repo installed (non-editable) into the interpreter's site-packages, bytecode and all."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site_dir = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    (site_dir / "host.pth").write_text(sysconfig_purelib() + "\n")  # pytest comes from the test's environment
    shutil.copytree(dirty_repo / "textkit", site_dir / "textkit")
    env = FeatureDeletionEnv(dirty_repo, symbols=["to_roman"], python=py, progress=False, timeout_s=30)
    assert env.installed_copies == [str((site_dir / "textkit").resolve())]
    task = env.tasks("all")[0]
    hack = _hack(
        """
        import importlib.util
        for entry in sys.path:
            path = os.path.join(entry, 'textkit', 'roman.py')
            if entry and os.path.abspath(path) != os.path.abspath(__file__) and os.path.exists(path):
                spec = importlib.util.spec_from_file_location('textkit_copy', path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                return mod.to_roman
        raise RuntimeError('no installed copy')
        """
    )
    assert naive_passes(dirty_repo, task, hack, tmp_path, python=py)
    fb = env.score(hack, task)
    assert fb.reward == 0.0 and "no installed copy" in fb.message + str(fb.details.get("stdout")), fb
    assert env.score(code_block(task["original_source"]), task).reward == 1.0


def sysconfig_purelib() -> str:
    import sysconfig

    return sysconfig.get_path("purelib")


def test_patching_pytest_is_detected(dirty_env, dirty_repo, tmp_path):
    env, task = dirty_env
    tamper = code_block(
        """
        def to_roman(n):
            return ''

        def _neuter(_=setattr(__import__('_pytest.python', fromlist=['x']).Function, 'runtest', lambda self: None)):
            pass
        """
    )
    assert naive_passes(dirty_repo, task, tamper, tmp_path)  # every test "passes" without the checks
    fb = env.score(tamper, task)
    assert fb.kind == "tampered" and fb.reward == 0.0


def test_rewriting_the_tests_is_refused(dirty_env):
    env, task = dirty_env
    rewrite = code_block(
        """
        def to_roman(n):
            return ''

        def _w(_=open('tests/test_roman.py', 'w').write('def test_ok():\\n    pass\\n')):
            pass
        """
    )
    fb = env.score(rewrite, task)
    assert fb.reward == 0.0
    assert "Read-only" in fb.details["stdout"] or "not allowed" in fb.details["stdout"]


@pytest.mark.parametrize("expose", [None, "allowlist", "all"])
def test_another_copy_of_the_repo_is_hidden_unless_widened(expose, tmp_path):
    """A second checkout outside the hidden paths: invisible by default (and with ``allowlist``); widening the
    view with ``sandbox_expose="all"`` makes it readable, and the copy hack then scores (the test can fail)."""
    import tempfile

    other = Path(tempfile.mkdtemp(prefix="cp-other-checkout-", dir="/var/tmp"))
    try:
        shutil.copytree(FIXTURE_REPO, other / "textkit")
        for p in [other, *other.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)  # readable by anyone, as a checkout usually is
        kw = {} if expose is None else {"sandbox_expose": expose}
        env = FeatureDeletionEnv(FIXTURE_REPO, symbols=["to_roman"], progress=False, timeout_s=30, **kw)
        task = env.tasks("all")[0]
        completion = _hack(HACKS["original_checkout"].replace("ORIGINAL", repr(str(other / "textkit"))))
        fb = env.score(completion, task)
        if expose == "all":
            assert fb.reward == 1.0, fb  # documented: the widened view hides only the paths the env knows
        else:
            assert fb.reward == 0.0, fb
            assert env.score(code_block(task["original_source"]), task).reward == 1.0
    finally:
        shutil.rmtree(other, ignore_errors=True)
