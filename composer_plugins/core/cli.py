"""The ``composer-plugins`` command line. Plugins add subcommands through ``register_commands(cli)``."""

from __future__ import annotations

import functools
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
    from composer_plugins.core.plugins import _strict

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


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    from composer_plugins.core.errors import ComposerPluginsError

    try:
        return load_commands().main(args=argv, prog_name="composer-plugins", standalone_mode=True)
    except ComposerPluginsError as e:  # raised outside a command (e.g. while loading plugins)
        report_error(e)


if __name__ == "__main__":  # pragma: no cover
    main()
