"""The ``composer-plugins`` command line. Plugins add subcommands through ``register_commands(cli)``."""

from __future__ import annotations

import functools
import json
import shutil
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from composer_plugins.core.version import __version__

#: Help of ``-S/--set``: the one override syntax of every command that reads a config.
SET_HELP = "Override a config value, e.g. -S trainer.max_steps=20 (repeatable; as `dvc exp run -S`)."


def set_option(f: Any) -> Any:
    """Add ``-S/--set KEY.SUB=VALUE`` (repeatable) as the ``set_overrides`` argument of a click command.

    ``-S`` is the one override syntax of the command line (DVC users know it from ``dvc exp run -S``);
    commands that also take positional ``KEY.SUB=VALUE`` arguments keep them as an alias and apply
    them first (see :func:`all_overrides`).
    """
    return click.option("-S", "--set", "set_overrides", multiple=True, metavar="KEY.SUB=VALUE", help=SET_HELP)(f)


def all_overrides(positional: tuple[str, ...] | list[str], set_overrides: tuple[str, ...] | list[str]) -> list[str]:
    """Positional ``KEY=VALUE`` overrides (the older alias) then ``-S`` ones, in the order they apply."""
    return [*positional, *set_overrides]


def key_values(options: tuple[str, ...] | list[str], param_hint: str) -> dict[str, Any]:
    """``key=value`` options as a dict, each value read as YAML (an empty one stays ``""``)."""
    from composer_plugins.core.config import yaml_load

    out: dict[str, Any] = {}
    for opt in options:
        if "=" not in opt:
            raise click.BadParameter(f"{opt!r} must look like key=value", param_hint=param_hint)
        k, _, v = opt.partition("=")
        out[k.strip()] = yaml_load(v) if v.strip() else v
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="composer-plugins")
@click.option("--no-progress", is_flag=True, help="No progress bars in any command (ours, transformers', the Hub's).")
def cli(no_progress: bool) -> None:
    """Compose RL, hint self-distillation and multi-teacher replay losses from plugins.

    Config overrides are given as -S key.sub=value in every command (as `dvc exp run -S`).
    """
    if no_progress:
        from composer_plugins.core import progress

        progress.silence()


def _table(rows: list[list[str]], headers: list[str]) -> str:
    width = shutil.get_terminal_size((120, 20)).columns
    cols = list(zip(headers, *rows, strict=False))
    widths = [max(len(str(c)) for c in col) for col in cols]
    # shrink the description column (index 2) to fit the terminal
    fixed = sum(w for i, w in enumerate(widths) if i != 2) + 2 * (len(widths) - 1)
    widths[2] = max(20, min(widths[2], width - fixed))
    lines = []
    for r in [headers, ["-" * w for w in widths], *rows]:
        cells = []
        for i, c in enumerate(r):
            c = str(c)
            if len(c) > widths[i]:
                c = c[: widths[i] - 1] + "…"
            cells.append(c.ljust(widths[i]))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@cli.command(name="list")
@click.argument("kind", required=False)
@click.argument("pattern", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(kind: str | None, pattern: str | None, as_json: bool) -> None:
    """List registered components, optionally of one KIND and matching PATTERN.

    KIND is one of {kinds}. PATTERN is an fnmatch
    pattern (a plain word matches as a substring; a leading ! excludes).
    """
    from composer_plugins.core.errors import UnknownPluginError
    from composer_plugins.core.plugins import get_registry
    from composer_plugins.core.registry import KINDS

    reg = get_registry()
    try:
        entries = sorted(
            [*reg.entries(kind, pattern), *reg.not_installed(kind, pattern)],
            key=lambda e: (list(KINDS).index(e.kind), e.name),
        )
    except UnknownPluginError as e:
        raise click.UsageError(str(e)) from e
    if as_json:
        click.echo(json.dumps([_entry_json(e) for e in entries], indent=2))
        return
    rows = []
    for e in entries:
        desc = e.description
        if not e.available:
            desc = f"[not installed: {e.install or 'pip install ' + ' '.join(e.missing)}] {desc}"
        elif bad := e.contract_problem(load=False):
            desc = f"[FAILS its contract check: {bad}] {desc}"
        rows.append([e.name, e.kind, desc, e.provider or e.plugin])
    if not rows:
        click.echo(f"No {kind or 'components'} match{' ' + repr(pattern) if pattern else ''}.")
        return
    click.echo(_table(rows, ["NAME", "KIND", "DESCRIPTION", "PROVIDER"]))
    for msg in reg.broken:
        click.secho(f"warning: {msg}", err=True, fg="yellow")


def kinds_text() -> str:
    """The registry's kinds as the CLI and README.md name them: ``losses, teachers, ...`` (one source, ``KINDS``)."""
    from composer_plugins.core.registry import KINDS

    return ", ".join(KINDS)


list_cmd.help = (list_cmd.help or "").replace("{kinds}", kinds_text())


def _entry_json(e: Any) -> dict[str, Any]:
    bad = e.contract_problem(load=False)
    return {
        "name": e.name,
        "kind": e.kind,
        "description": e.description,
        "distribution": e.distribution,
        "version": e.version,
        "plugin": e.plugin,
        "available": e.available,
        **({"install": e.install or "pip install " + " ".join(e.missing)} if not e.available else {}),
        **({"contract_problem": bad} if bad else {}),
    }


@cli.command()
@click.option("--all", "include_all", is_flag=True, help="Include the built-in default plugins.")
@click.option("--hook", "hooks", multiple=True, help="Only plugins implementing this hook.")
@click.option("--requirements", is_flag=True, help="Print pinned distributions (name==version) instead.")
def plugins(include_all: bool, hooks: tuple[str, ...], requirements: bool) -> None:
    """Print installed plugins as JSON: distribution, version, hooks implemented, and what failed (loading, or a
    registered component's contract check: ``"contract": "FAILED"`` with the reasons)."""
    from composer_plugins.core.plugins import get_plugin_manager, get_registry

    reg = get_registry()  # registering finds name clashes; they are listed with the plugin that made them
    infos = get_plugin_manager().plugin_infos(include_defaults=include_all)
    shown = {i.name: i for i in infos}
    for e in reg.entries():  # each registered entry's contract check; a plugin with a failing one is marked
        why = e.contract_problem() if e.plugin in shown else None
        if why:
            shown[e.plugin].contract_failures[f"{e.kind}/{e.name}"] = why
    if hooks:
        infos = [i for i in infos if set(hooks) & set(i.hooks)]
    if requirements:
        for d in sorted({(i.distribution, i.version) for i in infos if i.distribution and not i.default}):
            click.echo(f"{d[0]}=={d[1]}")
        return
    click.echo(json.dumps([i.as_dict() for i in infos], indent=2))
    if not infos and not include_all and not hooks:
        click.secho(
            "No third-party plugins are installed; `composer-plugins plugins --all` lists the built-in ones "
            "too (`composer-plugins list` lists every component).",
            err=True,
            fg="yellow",
        )


_commands_loaded = False


def load_commands() -> click.Group:
    """Let every plugin add its subcommands (once), then return the group."""
    global _commands_loaded
    if not _commands_loaded:
        from composer_plugins.core.plugins import get_plugin_manager

        get_plugin_manager().hook.register_commands(cli=cli)
        _plain_help(cli)
        _commands_loaded = True
    return cli


def _plain_help(cmd: click.Command) -> None:
    """Show reST inline literals of docstrings (````x````) as ```x``` in ``--help``, for every command and option."""

    def plain(text: str | None) -> str | None:
        return text.replace("``", "`") if text else text

    cmd.help = plain(cmd.help)
    cmd.short_help = plain(cmd.short_help)
    for p in cmd.params:
        if isinstance(p, click.Option):
            p.help = plain(p.help)
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _plain_help(sub)


def report_error(e: BaseException) -> NoReturn:
    """The one click error handler: ``Error: <message>`` in red on stderr, exit status 2.

    With ``COMPOSER_PLUGINS_STRICT=1`` the whole traceback is printed instead (the failing
    plugin's own frames included). Commands reach it through :func:`command_errors`.
    """
    if _strict():
        import traceback

        traceback.print_exception(e, file=sys.stderr)
    else:
        click.secho(f"Error: {e}", err=True, fg="red")
    sys.exit(2)


def report_interrupt(e: BaseException) -> NoReturn:
    """The one Ctrl-C handler: ``interrupted: <what was saved>; <how to continue>`` (an
    :class:`~composer_plugins.core.errors.Interrupted`'s message) in yellow on stderr, exit status 130 (128 +
    SIGINT, what a shell reports for a process Ctrl-C stopped)."""
    msg = str(e) if str(e).startswith("interrupted") else "interrupted before anything was saved; run it again"
    click.secho(msg, err=True, fg="yellow")
    sys.exit(130)


def command_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a click command so a :class:`ComposerPluginsError` it raises goes to :func:`report_error`, and
    Ctrl-C to :func:`report_interrupt`."""
    from composer_plugins.core.errors import ComposerPluginsError

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except ComposerPluginsError as e:
            report_error(e)
        except KeyboardInterrupt as e:
            report_interrupt(e)

    return wrapper


def cli_reference(width: int = 100) -> str:
    """``docs/cli.md``: the ``--help`` of every built-in command, as the commands print it.

    ``python scripts/cli_docs.py`` writes it; ``tests/core/test_core_cli_docs.py`` fails when the file and
    the commands disagree. Commands added by third-party plugins are left out.
    """
    from click.testing import CliRunner

    group = load_commands()
    out = [
        "# Command-line reference",
        "",
        "<!-- generated by `python scripts/cli_docs.py` from the commands' own --help; do not edit -->",
        "",
        "Every command that reads a config takes `-S key.sub=value` (repeatable) to override it, as",
        "`dvc exp run -S` does; positional `key.sub=value` arguments are accepted too (an alias).",
        "`python -m composer_plugins` is the same command line as `composer-plugins`, and",
        "`composer-plugins --no-progress <command>` (or `COMPOSER_PROGRESS=0`) silences every progress bar.",
        "",
    ]

    def walk(cmd: click.Command, path: tuple[str, ...]) -> None:
        mod = getattr(cmd.callback, "__module__", "") or ""
        if path and mod.split(".")[0] != "composer_plugins":  # not composer_plugins_<third party>
            return
        res = CliRunner().invoke(group, [*path, "--help"], terminal_width=width, prog_name="composer-plugins")
        title = " ".join(("composer-plugins", *path))
        out.extend([f"## `{title}`", "", "```console", f"$ {title} --help", res.output.rstrip(), "```", ""])
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                walk(cmd.commands[name], (*path, name))

    walk(group, ())
    return "\n".join(out)


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    from composer_plugins.core.errors import ComposerPluginsError

    try:
        return load_commands().main(args=argv, prog_name="composer-plugins", standalone_mode=True)
    except ComposerPluginsError as e:  # raised outside a command (e.g. while loading plugins)
        report_error(e)


def _strict() -> bool:
    import os

    from composer_plugins.core.plugins import STRICT_ENV

    return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


if __name__ == "__main__":  # pragma: no cover
    main()
