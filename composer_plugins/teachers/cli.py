"""``composer-plugins replay``: run a replay from a config, record traces, inspect, normalise.

Attached to the main CLI by :mod:`composer_plugins.teachers.plugin` through ``register_commands``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from composer_plugins.core.cli import all_overrides, command_errors, key_values, set_option
from composer_plugins.core.errors import ComposerPluginsError

#: Exit status of ``replay run`` when more calls went unanswered than ``max_unanswered`` allows.
EXIT_UNANSWERED = 3


@click.group(name="replay")
def replay() -> None:
    """Replay recorded student traces through N teachers and turn their agreement into preference pairs."""


@replay.command(name="run")
@click.option(
    "--config",
    "-c",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Replay YAML config (see docs/replay.md).",
)
@click.argument("overrides", nargs=-1)
@set_option
@click.option("--no-progress", is_flag=True, help="No progress bars at all (ours, transformers', the Hub's).")
@click.option("--fresh-budget", is_flag=True, help="Forget what earlier runs with this run_id spent.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON only.")
@command_errors
def run_cmd(
    config_path: str,
    overrides: tuple[str, ...],
    set_overrides: tuple[str, ...],
    no_progress: bool,
    fresh_budget: bool,
    as_json: bool,
) -> None:
    """Run the replay described by --config (-S key.sub=value overrides; positional ones are an alias)."""
    from composer_plugins.teachers.runner import run_from_file

    every = all_overrides(overrides, set_overrides)
    if no_progress:
        from composer_plugins.core import progress

        progress.silence()
    try:
        summary = run_from_file(
            config_path, every, progress=False if no_progress else None, fresh_budget=fresh_budget or None
        )
    except ComposerPluginsError:
        raise
    except OSError as e:  # a file problem the checks did not foresee: a message, not a traceback
        raise ComposerPluginsError(f"{type(e).__name__}: {e}") from None
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        _print_summary(summary)
    if sk := summary.get("skipped"):
        more = (
            f" and {sk['no_student_step'] - len(sk['where'])} more" if sk["no_student_step"] > len(sk["where"]) else ""
        )
        click.secho(
            f"warning: {sk['no_student_step']} conversation(s) hold no student step (an assistant message after "
            f"an earlier message) and were skipped: {', '.join(sk['where'])}{more}",
            err=True,
            fg="yellow",
        )
    if not summary.get("ok", True):
        f = summary["failures"]
        click.secho(
            f"Error: {f['unanswered']} of {summary['replay']['jobs']} teacher calls got no answer "
            f"({f['unanswered_fraction']:.1%}; max_unanswered is {f['max_unanswered']:g}): {f['by_kind']}. "
            "HINT: fix the cause and rerun (answers already in the cache are not paid again), or raise "
            "max_unanswered to accept a partial replay.",
            err=True,
            fg="red",
        )
        sys.exit(EXIT_UNANSWERED)


def _print_summary(s: dict[str, Any]) -> None:
    r, p = s["replay"], s["pairs"]
    cap = f" / ${r['max_usd']:g}" if r.get("max_usd") is not None else ""
    click.echo(f"run {s['run_id']}: {s['states']} states x {len(s['teachers'])} teachers")
    click.echo(
        f"  calls sent {r['calls']}  completed {r['completed']}  cache hits {r['cache_hits']}  retries {r['retries']}  "
        f"failures {r['failures']} (budget-skipped {r['skipped_budget']})"
    )
    click.echo(
        f"  spend this process ${r['spent_usd']:.6f} (+${r['uncertain_usd']:.6f} uncertain); "
        f"run total ${r['total_spent_usd']:.6f}{cap}"
    )
    click.echo(
        f"  pairs {p['pairs']}  student agrees {p['student_agrees']}  no consensus {p['no_consensus']}  "
        f"ties {p['ties']}  too few answers {p['too_few_answers']}"
    )
    if n := s.get("normalize"):
        click.echo(f"  data-juicer kept {n['n_out']}/{n['n_in']} pairs")
    click.echo(f"  wrote {s['output']}")
    if s["failures"]["total"]:
        click.secho(f"  {s['failures']['total']} call(s) got no answer: {s['failures']['by_kind']}", fg="yellow")


@replay.command(name="record")
@click.option("--policy", required=True, help="Student policy: a local HF model directory (save_pretrained).")
@click.option("--env", "env_name", required=True, help="Env name from the registry (composer-plugins list envs).")
@click.option("--env-arg", "env_args", multiple=True, help="key=value passed to the env factory (repeatable).")
@click.option("--episodes", default=8, show_default=True, type=int)
@click.option("--max-turns", default=4, show_default=True, type=int)
@click.option("--max-new-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Output OpenAI-messages JSONL.")
@click.option("--no-progress", is_flag=True)
@command_errors
def record_cmd(
    policy: str, env_name: str, env_args: tuple[str, ...], out_path: str, no_progress: bool, **settings: Any
) -> None:
    """Record traces of POLICY rolling out in ENV (ready for `replay run`)."""
    from composer_plugins.teachers.record import record_to_file

    kwargs = key_values(env_args, "--env-arg")
    summary = record_to_file(policy, env_name, out_path, env_args=kwargs, progress=not no_progress, **settings)
    click.echo(json.dumps(summary, sort_keys=True))


@replay.command(name="states")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--format", "fmt", default="auto", type=click.Choice(["auto", "openai", "claude_code"]))
@click.option("--limit", default=None, type=int)
@click.option("--jsonl", is_flag=True, help="Print every state as JSON lines instead of a summary.")
@command_errors
def states_cmd(paths: tuple[str, ...], fmt: str, limit: int | None, jsonl: bool) -> None:
    """Show the student steps read from trace files."""
    from composer_plugins.teachers.traces import load_traces

    states = load_traces(list(paths), format=fmt, limit=limit)  # type: ignore[arg-type]
    if jsonl:
        for s in states:
            click.echo(json.dumps(s.to_dict(), ensure_ascii=False))
        return
    traces = {s.trace_id for s in states}
    click.echo(f"{len(states)} student steps in {len(traces)} trace(s)")
    for s in states[:5]:
        click.echo(f"  {s.state_id}  ({len(s.messages)} msgs)  student: {s.student_text[:70]!r}")


@replay.command(name="normalize")
@click.argument("in_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path", type=click.Path(dir_okay=False))
@click.option(
    "--recipe",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="data-juicer recipe (default: the shipped recipes/pairs.yaml).",
)
@command_errors
def normalize_cmd(in_path: str, out_path: str, recipe: str | None) -> None:
    """Run the data-juicer recipe over a pairs JSONL file."""
    from composer_plugins.core.io import atomic_write_jsonl, read_jsonl
    from composer_plugins.teachers.normalize import normalize_pairs

    kept, report = normalize_pairs(read_jsonl(in_path), recipe)
    atomic_write_jsonl(out_path, kept)
    click.echo(json.dumps(report.to_dict(), sort_keys=True))
