"""Default plugin: the ``lightning`` backend and the ``composer-plugins backend`` commands.

Upstream backends register from their own distributions (``packages/``), lazily, so listing backends never
imports an upstream library; a known one not installed is listed with its pip command
(:data:`~composer_plugins.core.registry.KNOWN_BACKENDS`). See docs/backends.md "Packaging and the version matrix".
"""

from __future__ import annotations

from typing import Any

from composer_plugins.core.hookspecs import hookimpl


@hookimpl
def register_backends(register: Any) -> None:
    """Register the built-in ``lightning`` backend (alias ``native``)."""
    register(
        "lightning",
        "composer_plugins.backends.lightning:LightningBackend",
        "Native path: the composed channels in ComposerModule, trained by a Lightning Trainer.",
        requires=["lightning"],
        install="pip install composer-plugins",
        aliases=("native",),
    )


@hookimpl
def register_commands(cli: Any) -> None:
    """Add ``composer-plugins backend info|run|export``."""
    import click

    @cli.group(name="backend")
    def backend() -> None:
        """Run the loss channels in another trainer (lightning, trl, verl, prime_rl, monarch)."""

    @backend.command(name="info")
    @click.argument("name", required=False)
    def info(name: str | None) -> None:
        """Install command, tested upstream, what runs on CPU here and what needs GPUs."""
        import json

        from composer_plugins.core.plugins import get_registry

        reg = get_registry()
        if name:
            entries = [reg.get("backends", name)]
        else:
            entries = sorted([*reg.entries("backends"), *reg.not_installed("backends")], key=lambda e: e.name)
        out = []
        for e in entries:
            row: dict[str, Any] = {"name": e.name, "available": e.available, "install": e.install}
            if e.available and hasattr(e.factory, "info"):
                row.update({k: v for k, v in e.factory.info().items() if k != "name"})
            out.append(row)
        click.echo(json.dumps(out, indent=2))

    def _build(name: str, loaded: tuple[Any, Any], options: tuple[str, ...], need_upstream: bool = True) -> Any:
        from composer_plugins.core.config import yaml_load
        from composer_plugins.core.plugins import get_registry

        kw: dict[str, Any] = {}
        for opt in options:
            key, sep, value = opt.partition("=")
            if not sep:
                raise click.BadParameter(f"expected KEY=VALUE, got {opt!r}", param_hint="--opt")
            kw[key.strip()] = yaml_load(value)
        entry = get_registry().get("backends", name)
        if need_upstream:
            return entry.build(config=loaded, **kw)
        return entry.factory(config=loaded, **kw)  # exporting a launch config does not import the upstream

    def _common(f: Any) -> Any:
        from composer_plugins.training.runs.commands import config_options

        f = click.option(
            "--opt",
            "options",
            multiple=True,
            metavar="KEY=VALUE",
            help="Backend option (e.g. mode=local, generators=2, max_steps=5).",
        )(f)
        return click.argument("name")(config_options(f))

    @backend.command(name="run")
    @_common
    def run(cfg: Any, src: Any, name: str, options: tuple[str, ...]) -> None:
        """Train the config's channels with backend NAME; print the final metrics as JSON."""
        import json

        res = _build(name, (cfg, src), options).train()
        click.echo(json.dumps(res.metrics, indent=2, sort_keys=True, default=str))
        click.echo(f"model: {res.model_dir}")

    @backend.command(name="export")
    @_common
    def export(cfg: Any, src: Any, name: str, options: tuple[str, ...]) -> None:
        """Print what launches the config in the upstream trainer (VeRL command line, PRIME-RL TOML)."""
        import shlex

        b = _build(name, (cfg, src), options, need_upstream=False)
        launch = shlex.join(b.command()) if hasattr(b, "command") else b.toml() if hasattr(b, "toml") else None
        if launch is not None:
            click.echo(launch, nl=hasattr(b, "command"))
        else:
            raise click.ClickException(f"backend {name!r} runs in-process: use `composer-plugins backend run {name}`")
