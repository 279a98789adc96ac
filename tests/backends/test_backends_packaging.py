"""Backend registration, lazy upstream imports, `composer-plugins list backends`, and the per-backend distributions.

The core distribution holds the ``lightning`` backend; trl, verl, prime_rl and monarch each live in their own
``packages/composer-plugins-<backend>`` distribution and register through its ``composer_plugins`` entry point
(loaded here by the autouse fixture of ``tests/backends/conftest.py``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from composer_plugins.core import plugins
from composer_plugins.core.errors import MissingDependencyError, UnknownPluginError
from composer_plugins.core.registry import KNOWN_BACKENDS

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("lightning", "trl", "verl", "prime_rl", "monarch")
#: distribution -> (import name of its module, upstream distribution, upstream import name)
DISTRIBUTIONS = {
    "composer-plugins-trl": ("composer_plugins_trl", "trl", "trl"),
    "composer-plugins-verl": ("composer_plugins_verl", "verl", "verl"),
    "composer-plugins-prime-rl": ("composer_plugins_prime_rl", None, "prime_rl"),
    "composer-plugins-monarch": ("composer_plugins_monarch", "torchmonarch", "monarch"),
}


def _pyproject(dist: str) -> dict:
    return tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())


def test_every_backend_is_registered_through_the_public_hook_of_its_distribution():
    reg = plugins.get_registry()
    assert set(BACKENDS) <= set(reg.names("backends"))
    e = reg.get("backends", "lightning")  # the one backend of the core distribution
    assert (e.plugin, e.distribution) == ("composer_plugins.backends.plugin", "composer-plugins")
    assert e.target == "composer_plugins.backends.lightning:LightningBackend"
    for dist, (module, _upstream, name) in DISTRIBUTIONS.items():
        e = reg.get("backends", name)
        # provenance is the package's own entry point, not the core distribution
        assert (e.plugin, e.distribution, e.version) == (module, dist, md.version(dist))
        assert isinstance(e.target, str) and e.target.startswith(f"{module}.backend:")
        assert e.factory.__module__ == f"{module}.backend"  # the adapter ships in the package
        assert e.requires == (name,) and e.description
        assert KNOWN_BACKENDS[name] in e.install
    assert reg.get("backends", "prime-rl").name == "prime_rl"


def test_listing_backends_imports_no_upstream_library():
    code = (
        "import sys\n"
        "from composer_plugins.core.cli import main\n"
        "try:\n    main(['list', 'backends', '--json'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('trl', 'verl', 'monarch', 'prime_rl', 'torch') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
        env={"COMPOSER_PLUGINS_LOAD": ",".join(DISTRIBUTIONS), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(out.stdout[: out.stdout.rindex("HEAVY")])}
    assert "HEAVY []" in out.stdout
    for name in ("lightning", "trl", "verl", "monarch"):
        assert rows[name]["available"] is True, rows[name]
    # prime-rl is not installable here (not on PyPI, Python 3.12): listed with the exact install command
    pr = rows["prime_rl"]
    assert pr["available"] is False
    assert "pip install ./packages/composer-plugins-prime-rl" in pr["install"] and "prime-rl &&" in pr["install"]


def test_missing_upstream_shows_the_install_command_in_list_and_build(monkeypatch):
    from click.testing import CliRunner

    from composer_plugins.core import cli

    pm = plugins.get_plugin_manager()
    reg = plugins.build_registry(pm)
    for name in ("trl", "verl", "monarch"):  # pretend the upstream is missing
        e = reg.get("backends", name)
        reg.register(
            "backends",
            name,
            e.target,
            e.description,
            requires=[f"{name}_not_installed_xyz"],
            install=e.install,
            override=True,
        )
    monkeypatch.setattr(plugins, "_registry", reg)
    monkeypatch.setattr(plugins, "_pm", pm)
    res = CliRunner().invoke(cli.load_commands(), ["list", "backends", "--json"])
    rows = {r["name"]: r for r in json.loads(res.output)}
    for name in ("trl", "verl", "monarch"):
        assert rows[name]["available"] is False and rows[name]["install"] == KNOWN_BACKENDS[name]
        with pytest.raises(MissingDependencyError, match=KNOWN_BACKENDS[name].replace("-", r"\-")):
            reg.get("backends", name).build()
    wide = CliRunner().invoke(cli.load_commands(), ["list", "backends"], terminal_width=400, env={"COLUMNS": "400"})
    assert "[not installed: pip install ./packages/composer-plugins-trl]" in wide.output


def test_a_backend_distribution_not_installed_is_listed_with_its_pip_command(monkeypatch):
    """Without its distribution (here: its entry point not loaded) a backend is still listed, and asking for it
    by name, to build or to run, names the pip command that brings it."""
    from click.testing import CliRunner

    from composer_plugins.core.cli import load_commands

    monkeypatch.setenv(plugins.LOAD_ENV, "")
    plugins.reset()
    reg = plugins.get_registry()
    assert reg.names("backends") == ["lightning"]
    cli = load_commands()
    res = CliRunner().invoke(cli, ["list", "backends", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert set(rows) == {"lightning", *KNOWN_BACKENDS}
    for name, install in KNOWN_BACKENDS.items():
        assert rows[name]["available"] is False and rows[name]["install"] == install
        assert rows[name]["distribution"] == install.split("/")[-1]
    wide = CliRunner().invoke(cli, ["list", "backends"], terminal_width=400, env={"COLUMNS": "400"})
    for install in KNOWN_BACKENDS.values():
        assert f"[not installed: {install}]" in wide.output
    from composer_plugins import build

    with pytest.raises(UnknownPluginError, match="pip install ./packages/composer-plugins-trl"):
        build("backends", "trl")
    res = CliRunner().invoke(cli, ["backend", "run", "trl"])
    assert res.exit_code == 2 and "pip install ./packages/composer-plugins-trl" in res.output
    res = CliRunner().invoke(cli, ["backend", "info"])
    info = {r["name"]: r for r in json.loads(res.output)}
    assert info["monarch"] == {"name": "monarch", "available": False, "install": KNOWN_BACKENDS["monarch"]}


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_distribution_is_installed_and_pins_a_tested_upstream_range(dist):
    module, upstream, _import_name = DISTRIBUTIONS[dist]
    meta = _pyproject(dist)["project"]
    assert meta["name"] == dist
    reqs = [Requirement(r) for r in meta["dependencies"]]
    names = {r.name for r in reqs}
    assert "composer-plugins" in names
    # installed the way the README/CI does it (pip install ./packages/<dist> -c constraints.txt)
    assert md.version(dist) == meta["version"], f"{dist} is not installed: run scripts/install.sh dev"
    installed_reqs = {Requirement(r).name for r in (md.requires(dist) or [])}
    assert installed_reqs == names
    mod = __import__(module)
    assert mod.UPSTREAM
    if upstream is not None:
        req = next(r for r in reqs if r.name == upstream)
        assert req.specifier, f"{dist}: {upstream} needs a version range"
        assert md.version(upstream) in req.specifier, f"installed {upstream} {md.version(upstream)} outside {req}"
        assert str(req.specifier) and Requirement(mod.UPSTREAM).specifier == req.specifier
    for r in reqs:  # every installed dependency satisfies the distribution's range
        try:
            v = md.version(r.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{dist} depends on {r.name}, which is not installed")
        assert not r.specifier or v in r.specifier, f"{r.name} {v} not in {r}"


def test_entry_points_of_the_distributions():
    """Each distribution registers its backend through its own ``composer_plugins`` entry point; verl's also
    loads the adapter into VeRL's registries (``verl.plugins``)."""
    for dist, (module, _upstream, _name) in DISTRIBUTIONS.items():
        eps = {(ep.group, ep.name): ep.value for ep in md.distribution(dist).entry_points}
        expected = {("composer_plugins", module): f"{module}.plugin"}
        if dist == "composer-plugins-verl":
            expected[("verl.plugins", "composer_plugins")] = "composer_plugins_verl.backend"
        assert eps == expected, dist
        assert _pyproject(dist)["project"]["entry-points"]["composer_plugins"] == {module: f"{module}.plugin"}
    core_groups = {ep.group for ep in md.distribution("composer-plugins").entry_points}
    assert "composer_plugins" not in core_groups  # the core's backends plugin is a built-in default


def _wheel(src: Path, parts: list[str], tmp: Path) -> tuple[set[str], str]:
    """Build the wheel of a copy of ``src`` (its ``parts`` only, so the tree gets no build/ directory).

    Returns the wheel's file names and its ``entry_points.txt``.
    """
    import shutil
    import zipfile

    work = tmp / "src"
    for part in parts:
        if (src / part).is_dir():
            shutil.copytree(src / part, work / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            work.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / part, work / part)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "wheels"),
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (whl,) = (tmp / "wheels").glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        ep = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
        return names, z.read(ep).decode() if ep else ""


@pytest.mark.slow
def test_the_core_wheel_holds_no_upstream_adapter_and_each_package_wheel_holds_its_own(tmp_path):
    core, core_eps = _wheel(ROOT, ["composer_plugins", "pyproject.toml", "README.md"], tmp_path / "core")
    backends = {f.rsplit("/", 1)[-1] for f in core if f.startswith("composer_plugins/backends/")}
    assert backends == {"__init__.py", "base.py", "lightning.py", "plugin.py", "rollout.py", "support.py", "surface.py"}
    assert "[composer_plugins]" not in core_eps
    for dist, (module, _upstream, _name) in DISTRIBUTIONS.items():
        src = ROOT / "packages" / dist
        files, eps = _wheel(src, [module, "pyproject.toml", "README.md"], tmp_path / dist)
        assert {f"{module}/__init__.py", f"{module}/backend.py", f"{module}/plugin.py"} <= files, dist
        assert f"[composer_plugins]\n{module} = {module}.plugin" in eps, (dist, eps)


def test_constraints_pin_a_combination_every_distribution_accepts():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            pins[r.name] = r.specifier
    core = Requirement(
        next(
            d
            for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if d.startswith("transformers")
        )
    )
    tf = md.version("transformers")
    assert tf in pins["transformers"] and tf in core.specifier
    verl_tf = next(Requirement(r) for r in md.requires("verl") if r.startswith("transformers"))
    assert tf in verl_tf.specifier  # verl 0.9.1: >=5.5.3,<5.11,!=5.6.0 — trl 1.16 accepts the same range
    for dist in DISTRIBUTIONS:
        for r in (Requirement(x) for x in _pyproject(dist)["project"]["dependencies"]):
            if r.name in pins and r.specifier:
                ok = [v for v in (md.version(r.name),) if v in r.specifier and v in pins[r.name]]
                assert ok, f"{dist}: {r} conflicts with constraints.txt {r.name}{pins[r.name]}"


def test_backend_info_says_what_runs_here_and_what_needs_gpus():
    from composer_plugins import get_registry

    for name in ("lightning", "trl", "verl", "monarch"):
        cls = get_registry().get("backends", name).factory
        info = cls.info()
        assert info["name"] == name and info["runs_here"] and info["needs_gpu"] and info["upstream"]


def test_backend_cli_info_and_export(tmp_path):
    from click.testing import CliRunner

    from composer_plugins.core.cli import load_commands

    cli = load_commands()
    cfg = tmp_path / "run.yaml"
    cfg.write_text("losses:\n  dapo: {weight: 1.0, epsilon_high: 0.3}\n  hint_distill: {weight: 0.5}\n")
    r = CliRunner().invoke(cli, ["backend", "export", "verl", "-c", str(cfg), "--opt", "mode=ray"])
    assert r.exit_code != 0 and f"{cfg}:3: losses.hint_distill" in r.output and "mode='ray'" in r.output
    cfg.write_text("losses:\n  dapo: {weight: 1.0, epsilon_high: 0.3}\n")
    r = CliRunner().invoke(cli, ["backend", "info", "verl"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)[0]
    assert info["available"] and info["upstream"] == "verl>=0.9.1,<0.10" and "main_ppo" in info["needs_gpu"]
    r = CliRunner().invoke(cli, ["backend", "export", "verl", "-c", str(cfg), "--opt", "mode=ray"])
    assert r.exit_code == 0, r.output
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=composer_dapo" in r.output
    assert "actor_rollout_ref.actor.clip_ratio_high=0.3" in r.output
    # exporting the PRIME-RL TOML needs no prime-rl install; a channel the upstream run cannot feed is refused
    cfg.write_text("losses:\n  dppo: {weight: 1.0, kl_tau: 0.01}\n  hint_distill: {weight: 0.5}\n")
    r = CliRunner().invoke(cli, ["backend", "export", "prime_rl", "-c", str(cfg), "trainer.max_steps=3"])
    assert r.exit_code != 0 and f"{cfg}:3: losses.hint_distill" in r.output and "mode='prime-rl'" in r.output
    cfg.write_text("losses:\n  dppo: {weight: 1.0, kl_tau: 0.01}\n")
    r = CliRunner().invoke(cli, ["backend", "export", "prime_rl", "-c", str(cfg), "trainer.max_steps=3"])
    assert r.exit_code == 0, r.output
    toml = tomllib.loads(r.output)
    assert toml["max_steps"] == 3 and toml["trainer"]["loss"]["kwargs"] == {"policy": "dppo", "kl_tau": 0.01}
    r = CliRunner().invoke(cli, ["backend", "export", "lightning", "-c", str(cfg)])
    assert r.exit_code != 0 and "runs in-process" in r.output
