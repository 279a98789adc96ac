"""The catalogue's commands: ``composer-plugins list`` (every registered component, with its provider and any
failed contract check) and ``composer-plugins plugins`` (every plugin, with what failed), added by
:mod:`.plugin` through ``register_commands`` like every other command."""

from __future__ import annotations

import json
import shutil
from typing import Any

import click

from composer_plugins.core.errors import UnknownPluginError
from composer_plugins.core.plugins import get_plugin_manager, get_registry
from composer_plugins.core.registry import KINDS


def _fit(cell: Any, width: int) -> str:
    text = str(cell)
    return (text if len(text) <= width else text[: width - 1] + "…").ljust(width)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    width = shutil.get_terminal_size((120, 20)).columns
    cols = list(zip(headers, *rows, strict=False))
    widths = [max(len(str(c)) for c in col) for col in cols]
    # shrink the description column (index 2) to fit the terminal
    fixed = sum(w for i, w in enumerate(widths) if i != 2) + 2 * (len(widths) - 1)
    widths[2] = max(20, min(widths[2], width - fixed))
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(_fit(c, widths[i]) for i, c in enumerate(r)).rstrip() for r in lines)


@click.command(name="list")
@click.argument("kind", required=False)
@click.argument("pattern", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_cmd(kind: str | None, pattern: str | None, as_json: bool) -> None:
    """List registered components, optionally of one KIND and matching PATTERN.

    KIND is one of {kinds}. PATTERN is an fnmatch
    pattern (a plain word matches as a substring; a leading ! excludes).
    """
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


@click.command()
@click.option("--all", "include_all", is_flag=True, help="Include the built-in default plugins.")
@click.option("--hook", "hooks", multiple=True, help="Only plugins implementing this hook.")
@click.option("--requirements", is_flag=True, help="Print pinned distributions (name==version) instead.")
def plugins(include_all: bool, hooks: tuple[str, ...], requirements: bool) -> None:
    """Print installed plugins as JSON: distribution, version, hooks implemented, and what failed (loading, or a
    registered component's contract check: ``"contract": "FAILED"`` with the reasons)."""
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
