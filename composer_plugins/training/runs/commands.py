"""The built-in training subcommands ``train``, ``sft`` and ``eval``, which :mod:`.plugin` attaches through the
public ``register_commands(cli)`` hook, the same way a third-party plugin adds one. Heavy imports (torch,
lightning, transformers) happen only when a command runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from composer_plugins.core import progress
from composer_plugins.core.cli import all_overrides, command_errors, report_interrupt, set_option
from composer_plugins.core.errors import Interrupted


def config_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """A command on a train config: ``--config``, ``--section``, ``--print-config``, ``--no-progress``,
    ``-S key.sub=value`` (and positional ones, an alias). The command is called with the loaded ``(cfg, src)``
    first (``--print-config`` prints the config and stops there); a :class:`ComposerPluginsError` it raises,
    loading included, is reported."""

    @functools.wraps(command)
    @command_errors
    def f(
        config_path: str | None,
        section: str | None,
        print_config: bool,
        overrides: tuple[str, ...],
        set_overrides: tuple[str, ...],
        no_progress: bool,
        **options: Any,
    ) -> None:
        from composer_plugins.training.config.train import config_to_yaml, load_train_config

        if no_progress:
            progress.silence()
        cfg, src = load_train_config(config_path, all_overrides(overrides, set_overrides), section=section)
        if print_config:
            click.echo(config_to_yaml(cfg), nl=False)
            return
        command(cfg, src, **options)

    f = click.argument("overrides", nargs=-1, metavar="[KEY.SUB=VALUE]...")(f)
    f = set_option(f)
    f = click.option("--no-progress", is_flag=True, help="No progress bars at all (ours, transformers', the Hub's).")(f)
    f = click.option("--print-config", is_flag=True, help="Print the effective config (YAML) and exit.")(f)
    f = click.option("--section", default=None, help="Use this top-level key of the file as the config.")(f)
    f = click.option(
        "--config",
        "-c",
        "config_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="YAML config (default: the packaged configs/default.yaml).",
    )(f)
    return f


def _check_inputs(cfg: Any, src: Any, checkpoint: str | None = None) -> None:
    """The paths a run reads (and an uncached hub id, offline or unreachable), checked before torch is imported."""
    from composer_plugins.training.config.inputs import check_checkpoint, check_inputs

    if checkpoint is None:
        check_inputs(cfg, src)
    else:
        check_checkpoint(checkpoint)


def _clear_run(output_dir: str) -> None:
    """``train --overwrite``: remove an earlier run's checkpoints, history and metrics from ``output_dir``."""
    out = Path(output_dir)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    for name in ("history.csv", "metrics.json"):
        (out / name).unlink(missing_ok=True)


@contextlib.contextmanager
def _located_policy(cfg: Any, src: Any) -> Iterator[None]:
    """A ``model.name_or_path`` the loader could not load, reported at that key (file:line or override)."""
    from composer_plugins.models.tiny import PolicyLoadError

    try:
        yield
    except PolicyLoadError as e:
        if e.name_or_path != str(cfg.model.name_or_path):
            raise
        raise src.error("model.name_or_path", e.problem) from e


@click.command(name="train")
@config_options
@click.option("--resume", default=None, help="'last' or a .ckpt path: continue a run exactly where it stopped.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Start over in an output_dir that holds an earlier run's checkpoints (they and its history.csv "
    "are deleted); without it (or --resume) such a directory is refused.",
)
def train_cmd(cfg: Any, src: Any, resume: str | None, overwrite: bool) -> None:
    """RL training: generate rollouts, score them with the env and optimise the composed loss channels.

    Ctrl-C stops it with exit status 130, naming the step and the last checkpoint (continue with --resume last).

    Example: composer-plugins train -c run.yaml -S trainer.max_steps=20 -S losses.hint_distill.enabled=false
    """
    if resume and overwrite:
        raise click.UsageError("--resume continues the run in output_dir and --overwrite deletes it: give one.")
    _check_inputs(cfg, src)
    if overwrite:
        _clear_run(cfg.output_dir)
    elif not resume:
        from composer_plugins.training.config.inputs import check_fresh_output_dir

        check_fresh_output_dir(cfg, src)
    try:
        from composer_plugins.training.runs.run import run_train  # torch, Lightning: the config is good

        with _located_policy(cfg, src):
            res = run_train(cfg, src, resume=resume)
    except KeyboardInterrupt as e:  # RunInterrupted names the step and the checkpoint
        if not isinstance(e, Interrupted):
            e = Interrupted("nothing saved (before the first step)", "run the same command again")
        report_interrupt(e)
    if not res.is_global_zero:  # trainer.devices > 1: every rank runs this command; rank 0 reports
        return
    click.echo(json.dumps(res.metrics, indent=2, sort_keys=True))
    click.echo(f"model: {res.model_dir}")
    if res.run_id:
        click.echo(f"mlflow run: {res.run_id}")


@click.command(name="sft")
@config_options
def sft_cmd(cfg: Any, src: Any) -> None:
    """Supervised warm start on the env's worked solutions (cached by config hash); writes <output_dir>/model."""
    _check_inputs(cfg, src)
    from composer_plugins.training.runs.run import run_sft  # torch, Lightning, transformers: after the config is good

    try:
        with _located_policy(cfg, src):
            model = run_sft(cfg, src)
    except KeyboardInterrupt:
        where = cfg.cache_dir if cfg.sft.cache else f"{cfg.output_dir}/sft"
        raise Interrupted(
            f"nothing saved (the warm start is kept in {where} only once it finishes)",
            "run the same command again to train it from the start",
        ) from None
    click.echo(f"model: {model}")


@click.command(name="eval")
@config_options
@click.option("--checkpoint", default=None, help="A Lightning .ckpt, a save_pretrained dir or a hub id.")
@click.option("--output", "-o", default=None, help="Write the metrics JSON here.")
def eval_cmd(cfg: Any, src: Any, checkpoint: str | None, output: str | None) -> None:
    """Held-out evaluation (accuracy, pass_at_<k>, mean_reward) of a checkpoint or of the configured policy."""
    _check_inputs(cfg, src, checkpoint)
    from composer_plugins.training.runs.run import run_eval  # torch, Lightning, transformers: after the config is good

    with _located_policy(cfg, src):
        metrics = run_eval(cfg, src, checkpoint=checkpoint, output=output)
    click.echo(json.dumps(metrics, indent=2, sort_keys=True))
