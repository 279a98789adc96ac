"""Default plugin: the DVC pipeline stage commands (``prepare``, ``rollout``, ``study``, ``report``, ``compare``).

Heavy imports (torch, transformers, mlflow) happen only when a command runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml

from composer_plugins.core.cli import command_errors
from composer_plugins.core.errors import ComposerPluginsError, Interrupted
from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.pipeline import study
from composer_plugins.pipeline.common import PATHS, env_key, is_num

PARAMS_HELP = "DVC params file (default: params.yaml)."


def _params_option(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--set",
        "-S",
        "overrides",
        multiple=True,
        metavar="KEY.SUB=VALUE",
        help="Override a param for this call only (repeatable).",
    )(f)
    return click.option(
        "--params",
        "-p",
        "params_path",
        default="params.yaml",
        show_default=True,
        type=click.Path(dir_okay=False),
        help=PARAMS_HELP,
    )(f)


def _load(params_path: str, overrides: tuple[str, ...]) -> Any:
    from composer_plugins.core import progress

    # a stage's output is a log (dvc repro): no library bar (transformers' "Loading weights") in it
    progress.quiet_libraries()
    return study.load_params(params_path, overrides)


def summary_line(stage: str, values: Any, where: str = "") -> str:
    """A stage's one line for the console (``dvc repro``): ``<stage>: k=v k=v -> <where>``; the full metrics
    are in the files the stage writes, not on the console."""
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (values or {}).items() if is_num(v)]
    return f"{stage}: {' '.join(parts)}{f' -> {where}' if where else ''}".replace(":  ->", ": ->")


@click.command(name="prepare")
@_params_option
@click.option("--out", default="data/tasks", show_default=True, help="Output directory.")
@command_errors
def prepare_cmd(params_path: str, overrides: tuple[str, ...], out: str) -> None:
    """Write the study's tasks: <out>/<env>/{train,test}.jsonl from the params' ``data`` section.

    GSM8K comes from the embedded seeded generator by default, or from a Hugging Face id
    (``data.gsm8k.source: hf``, ``hf_id: openai/gsm8k``) or a local file (``source: file``).
    """
    from composer_plugins.pipeline.stage_prepare import prepare

    manifest = prepare(_load(params_path, overrides), out)
    for k, e in manifest["envs"].items():
        click.echo(f"{k}: {e['train']['n']} train, {e['test']['n']} test ({e['source']})")
        if "computation_overlap" in e:
            click.echo(
                f"{k}: train/test overlap: {e['overlap']} test prompts, {e['computation_overlap']} test rows "
                f"({e['computation_overlap_distinct']} distinct) computing a train tuple; "
                f"{e['test_distinct']} distinct test prompts, {e['test_distinct_computations']} distinct computations"
            )
        if "first_line_overlap" in e:
            n = e["test"]["n"]
            click.echo(
                f"{k}: line overlap: {e['first_line_overlap']}/{n} test first lines, {e['second_line_overlap']}/"
                f"{e['second_line_rows']} second lines and {e['answer_overlap']}/{n} answers occur verbatim in train"
            )
        if "fact_overlap" in e:
            click.echo(
                f"{k}: procedure overlap: {e['fact_overlap']}/{e['fact_rows']} test rows use only train facts; "
                f"{e['operand_overlap']} an operand, {e['intermediate_overlap']} an intermediate result, "
                f"{e['answer_number_overlap']} an answer that is a number of some train problem"
            )


@click.command(name="rollout")
@_params_option
@click.option("--model", required=True, help="Policy directory or hub id (e.g. models/sft/model).")
@click.option(
    "--tasks",
    "tasks_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Tasks JSONL (e.g. data/tasks/gsm8k/train.jsonl).",
)
@click.option("--out", default="data/traces.jsonl", show_default=True, help="Traces JSONL to write.")
@command_errors
def rollout_cmd(params_path: str, overrides: tuple[str, ...], model: str, tasks_path: str, out: str) -> None:
    """Record student traces: sample the policy on training tasks and score them in the env."""
    from composer_plugins.pipeline.stage_rollout import rollout

    stats = rollout(_load(params_path, overrides), model, tasks_path, out)
    click.echo(summary_line("rollout", stats, f"{out} (stats: {out}.stats.json)"))


@click.command(name="replay-config")
@_params_option
@click.option("--out", default="data/replay/config.yaml", show_default=True, help="Where to write the config.")
@command_errors
def replay_config_cmd(params_path: str, overrides: tuple[str, ...], out: str) -> None:
    """Write the replay stage's `composer-plugins replay run` config (params' ``replay`` + pipeline paths)."""
    from composer_plugins.pipeline.stage_replay import replay_config

    # `{$env: NAME}` secrets are copied as references (resolved by `replay run`), never as values.
    cfg = replay_config(_load(params_path, overrides))
    header = "# generated by `composer-plugins study replay-config` from params.yaml\n"
    study.write_text(out, header + yaml.safe_dump(cfg, sort_keys=False))
    click.echo(f"wrote {out}")


@click.command(name="pairs")
@_params_option
@click.option("--traces", default="data/traces.jsonl", show_default=True, type=click.Path(exists=True))
@click.option(
    "--cache",
    default="data/teacher_cache/cache.sqlite",
    show_default=True,
    help="Teacher cache written by the replay stage.",
)
@click.option("--out", default="data/pairs.jsonl", show_default=True)
@command_errors
def pairs_cmd(params_path: str, overrides: tuple[str, ...], traces: str, cache: str, out: str) -> None:
    """Agreement-k preference pairs + data-juicer normalisation from the teacher cache (never pays)."""
    from composer_plugins.pipeline.stage_pairs import pairs

    summary = pairs(_load(params_path, overrides), traces, cache, out)
    counts = {"pairs": summary.get("pairs")}
    norm = summary.get("normalize")
    if isinstance(norm, dict):
        counts.update({f"normalize/{k}": v for k, v in norm.items()})
    click.echo(summary_line("pairs", counts, f"{out} (stats: {Path(out).with_suffix('.stats.json')})"))


@click.group(name="study")
def study_group() -> None:
    """Study cells (variant × seed): effective train configs and held-out evaluation."""


@study_group.command(name="config")
@_params_option
@click.option("--variant", required=True, help="A key of study.variants.")
@click.option("--seed", type=int, required=True)
@click.option("--out", default=None, help="Write the YAML here (default: stdout).")
@click.option("--pairs", default="data/pairs.jsonl", show_default=True, help="Preference pairs JSONL ('' for none).")
@click.option("--model", default="models/sft/model", show_default=True, help="Initial policy.")
@command_errors
def study_config_cmd(
    params_path: str, overrides: tuple[str, ...], variant: str, seed: int, out: str | None, pairs: str, model: str
) -> None:
    """Print (or write) the effective ``train`` config of one study cell, for ``composer-plugins train -c``."""
    from composer_plugins.pipeline.stage_train import train_config

    cfg = train_config(_load(params_path, overrides), variant, seed, pairs=pairs or None, model=model)
    text = f"# generated by `composer-plugins study config --variant {variant} --seed {seed}`\n"
    text += yaml.safe_dump(cfg, sort_keys=False)
    if out:
        study.write_text(out, text)
    else:
        click.echo(text, nl=False)


study_group.add_command(replay_config_cmd)


@study_group.command(name="train")
@_params_option
@click.option("--variant", required=True, help="A key of study.variants.")
@click.option("--seed", type=int, required=True)
@click.option("--pairs", default="data/pairs.jsonl", show_default=True, help="Preference pairs JSONL ('' for none).")
@click.option("--model", default="models/sft/model", show_default=True, help="Initial policy.")
@command_errors
def study_train_cmd(
    params_path: str, overrides: tuple[str, ...], variant: str, seed: int, pairs: str, model: str
) -> None:
    """Train one study cell: write runs/<variant>-s<seed>/config.yaml, then `composer-plugins train -c` it.

    With ``train.diloco.replicas > 1`` the cell trains with DiLoCo (``composer-plugins diloco``);
    replica 0's model, history and metrics are then copied to the cell's directory.
    """
    from composer_plugins.pipeline.stage_train import train_cell

    cell = f"{PATHS['runs']}/{study.run_name(variant, seed)}"
    try:
        res = train_cell(_load(params_path, overrides), variant, seed, pairs=pairs or None, model=model)
    except KeyboardInterrupt as e:
        step = getattr(e, "checkpoint_step", None)
        raise Interrupted(
            f"the cell {cell} stopped; " + (f"its last checkpoint is at step {step}" if step else "no checkpoint"),
            f"continue it with `composer-plugins train -c {cell}/config.yaml --resume last`"
            if step
            else "run the same command again to train it from the start",
        ) from None
    keys = ("train/reward_mean_over_steps", "train/reward", "train/loss", "val/accuracy")
    click.echo(
        summary_line(
            f"train@{study.run_name(variant, seed)}",
            {k: res[k] for k in keys if k in res},
            f"{cell}/model (metrics: {cell}/metrics.json, history.csv)",
        )
    )


@study_group.command(name="gap")
@_params_option
@click.option("--variant", "variant_names", multiple=True, help="A key of study.variants (repeat; default: all).")
@click.option("--model", default="models/sft/model", show_default=True, help="The student (the study's start).")
@click.option("--tasks", "tasks_path", default=None, help="Training prompts (default: data/tasks/<env>/train.jsonl).")
@click.option("--num-prompts", default=64, show_default=True, help="Prompts measured (one rollout of each).")
@click.option("--out", default="results/gap.json", show_default=True, help="Where to write the JSON.")
@command_errors
def study_gap_cmd(
    params_path: str,
    overrides: tuple[str, ...],
    variant_names: tuple[str, ...],
    model: str,
    tasks_path: str | None,
    num_prompts: int,
    out: str,
) -> None:
    """Before paying for RL: each variant's teachers' gap to the student on training prompts.

    For the hinted self-teacher and every external teacher a variant configures: the teacher margin
    (nats/token on the student's own samples), the fix rate (of the student's greedy failures it covers, the
    share the teacher solves) and the coverage. The paired report lists them beside each variant's effect.
    """
    from composer_plugins.pipeline import gap

    params = _load(params_path, overrides)
    names = list(variant_names) or list(study.variants(params))
    for v in names:
        study.variant_overrides(params, v)  # a located error naming the valid variants
    env = env_key((params.get("train") or {}).get("env", "gsm8k"))
    tasks = tasks_path or f"data/tasks/{env}/train.jsonl"
    res = gap.measure_gap(params, names, model=model, tasks_path=tasks, num_prompts=num_prompts)
    gap.write_gap(res, out)
    for v, teachers in res["variants"].items():
        for t, m in teachers.items():
            click.echo(
                f"{v}: {t}: margin {m['margin']:+.3f} nats/token, fix rate {m['fix_rate']:.3f}, "
                f"coverage {m['coverage']:.3f}"
            )
    click.echo(f"wrote {out}")


@study_group.command(name="eval")
@_params_option
@click.option("--variant", default=None, help="A key of study.variants (omit with --baseline).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--baseline", is_flag=True, help="Evaluate --model outside the study's cells (the SFT start by default).")
@click.option("--name", default="sft", show_default=True, help="The --baseline row's name, e.g. teacher.")
@click.option("--model", default=None, help="Policy to evaluate (default: runs/<variant>-s<seed>/model).")
@click.option("--out", default=None, help="Result JSON (default: evals/<variant>-s<seed>.json or evals/sft.json).")
@command_errors
def study_eval_cmd(
    params_path: str,
    overrides: tuple[str, ...],
    variant: str | None,
    seed: int,
    baseline: bool,
    name: str,
    model: str | None,
    out: str | None,
) -> None:
    """Held-out evaluation of one study cell on every env of ``eval.envs``; logs an MLflow run."""
    from composer_plugins.pipeline.stage_eval import evaluate

    if baseline == bool(variant):
        raise click.UsageError("give either --variant (a trained cell) or --baseline (the SFT start)")
    name = study.run_name(variant, seed) if variant else name
    model = model or (f"{PATHS['runs']}/{name}/model" if variant else PATHS["sft_model"])
    out = out or f"{PATHS['evals']}/{name}.json"
    hist = f"{PATHS['runs']}/{name}/history.csv" if variant else None
    # the SFT baseline run also records the warm start's own metrics (sft/loss)
    tm = f"{PATHS['runs']}/{name}/metrics.json" if variant else str(Path(model).parent / "metrics.json")
    params = _load(params_path, overrides)
    res = evaluate(params, variant, seed, model, out, history=hist, train_metrics=tm, baseline=name)
    held_out = {k: v for k, v in sorted(res["metrics"].items()) if not k.startswith(("train/", "sft/"))}
    click.echo(summary_line(f"eval@{name}", held_out, out))


@click.command(name="report")
@_params_option
@click.option("--evals", "evals_dir", default="evals", show_default=True)
@click.option("--runs", "runs_dir", default="runs", show_default=True)
@click.option("--metrics", "metrics_out", default="metrics.json", show_default=True)
@click.option("--plots", "plots_dir", default="plots", show_default=True)
@click.option("--table", "table_out", default="results/ablation.md", show_default=True)
@command_errors
def report_cmd(
    params_path: str,
    overrides: tuple[str, ...],
    evals_dir: str,
    runs_dir: str,
    metrics_out: str,
    plots_dir: str,
    table_out: str,
) -> None:
    """Aggregate the study: metrics.json, DVC plots and the ablation table (results/ablation.md)."""
    from composer_plugins.pipeline.stage_report import report

    res = report(_load(params_path, overrides), evals_dir, runs_dir, metrics_out, plots_dir, table_out)
    click.echo(res["table"])


@click.command(name="plots")
@click.option("--dvc-file", default="dvc.yaml", show_default=True, help="Whose plots: this dvc.yaml's only.")
@click.option("--out", "-o", default="dvc_plots", show_default=True, help="Folder of index.html and the SVGs.")
@click.option("--svg/--no-svg", default=True, show_default=True, help="Also one SVG per plot beside the page.")
@command_errors
def plots_cmd(dvc_file: str, out: str, svg: bool) -> None:
    """Render one dvc.yaml's plots, and no other's, as a page that works offline (and SVGs).

    A bare `dvc plots show` collects every dvc.yaml of the repository (studies/*/ too) and its page loads
    its charting library from a CDN. This shows the plots of --dvc-file only (at the root: the main study;
    in studies/<name>/: that study), with vega, vega-lite and vega-embed inline in the page.
    """
    from composer_plugins.pipeline.plots import render

    res = render(dvc_file, out, svg=svg)
    svgs = f" and {len(res['svgs'])} SVGs" if res["svgs"] else ""
    click.echo(f"plots: {len(res['plots'])} plots of {dvc_file} -> {res['html']}{svgs} (renders offline)")
    for e in res["errors"]:
        click.echo(f"plots: warning: {e}", err=True)


@click.command(name="compare")
@click.option("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI or params).")
@click.option("--experiment", default=None, help="MLflow experiment (default: params mlflow.experiment).")
@click.option("--params", "-p", "params_path", default="params.yaml", show_default=True, help=PARAMS_HELP)
@click.option("--metric", "metrics", multiple=True, help="Metric column(s) (default: the three headline metrics).")
@click.option(
    "--group-by",
    default=None,
    help="Comma-separated: channels, variant or a logged param (e.g. train.optim.lr). "
    "Default: channels plus every param that differs between runs of the same channels and "
    "seed (what a `dvc exp run -S` changed), so the baseline shows beside each experiment.",
)
@click.option("--filter", "filters", multiple=True, metavar="TAG=VALUE", help="Only runs with this tag value.")
@click.option("--all-runs", is_flag=True, help="Keep every run (default: the newest per group and seed).")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json", "csv"]), default="text")
@click.option(
    "--paired",
    is_flag=True,
    help="Each variant minus --baseline-variant per seed: mean, se, 95% t interval, verdict "
    "(composer_plugins.pipeline.paired).",
)
@click.option(
    "--baseline-variant",
    default=None,
    help="The reference of --paired (default: study.baseline of --params, else rl_only).",
)
@command_errors
def compare_cmd(
    tracking_uri: str | None,
    experiment: str | None,
    params_path: str,
    metrics: tuple[str, ...],
    group_by: str | None,
    filters: tuple[str, ...],
    all_runs: bool,
    fmt: str,
    paired: bool,
    baseline_variant: str | None,
) -> None:
    """Print the ablation table from MLflow: channels on/off × seeds -> held-out metrics, mean ± std.

    Without --group-by, rows are variant, channels × the params that an experiment changed, in the order
    of results/ablation.md (sft, then study.variants of --params), the baseline's row beside each
    experiment's, with an exp column (the dvc exp name, or baseline).
    """
    from composer_plugins.pipeline import compare
    from composer_plugins.pipeline.stage_eval import unmlflow_key
    from composer_plugins.training.lightning import tracking

    params = dict(study.load_params(params_path)) if Path(params_path).exists() else {}
    uri = tracking_uri or tracking.tracking_uri(params)
    exp = experiment or tracking.experiment_name(params)
    flt = {}
    for f in filters:
        k, sep, v = f.partition("=")
        if not sep:
            raise click.UsageError(f"--filter {f!r} must look like TAG=VALUE")
        flt[k] = v
    if paired:
        base = baseline_variant or (study.baseline(params) if params else None) or "rl_only"
        _print_paired(params, uri, exp, flt, metrics, base, fmt)
        return
    beside = group_by is None
    if beside:
        every = compare.fetch_eval_records(uri, exp, filters=flt, all_runs=True)
        groups: tuple[str, ...] = ("variant", "channels", *compare.varying_params(every))
    else:
        groups = tuple(g.strip() for g in str(group_by).split(",") if g.strip())
    recs = compare.fetch_eval_records(uri, exp, filters=flt, group_by=groups, all_runs=all_runs)
    if not recs:
        raise click.ClickException(
            f"no finished eval runs in experiment {exp!r} at {uri}. HINT: run `dvc repro` (or `dvc exp run`) first."
        )
    recs = [{unmlflow_key(k): v for k, v in r.items()} for r in recs]
    cols = [study.canonical_metric(m) for m in metrics] or [
        m for m in study.HEADLINE_METRICS if any(m in r for r in recs)
    ]
    order = ["sft", *study.variants(params)] if params.get("study") else []  # results/ablation.md's order
    click.echo(compare.compare_table(recs, cols, groups, fmt, beside=beside, variant_order=order))


def _print_paired(
    params: dict[str, Any],
    uri: str,
    exp: str,
    flt: dict[str, str],
    metrics: tuple[str, ...],
    baseline_variant: str,
    fmt: str,
) -> None:
    """``compare --paired``: every variant against ``baseline_variant``, paired by seed."""
    from composer_plugins.pipeline import compare, paired
    from composer_plugins.pipeline.stage_eval import unmlflow_key

    recs = compare.fetch_eval_records(uri, exp, filters=flt, group_by=("variant",))
    recs = [{unmlflow_key(k): v for k, v in r.items()} for r in recs]
    if not recs:
        raise click.ClickException(f"no finished eval runs in experiment {exp!r} at {uri}. HINT: run the study first.")
    gsm = ((params.get("eval") or {}).get("envs") or {}).get("gsm8k") or {}
    cols = [study.canonical_metric(m) for m in metrics] or ["gsm8k/accuracy"]
    try:
        effects = [x for m in cols for x in paired.paired_rows(recs, m, baseline_variant)]
    except ValueError as e:
        raise ComposerPluginsError(f"compare --paired: {e}") from None
    heldout = int(gsm["num_problems"]) if gsm.get("num_problems") and cols[0].startswith("gsm8k/") else None
    click.echo(paired.format_paired(effects, fmt, heldout_n=heldout))


@hookimpl
def register_commands(cli: Any) -> None:
    """Attach the pipeline subcommands."""
    for cmd in (prepare_cmd, rollout_cmd, pairs_cmd, study_group, report_cmd, plots_cmd, compare_cmd):
        if cmd.name not in cli.commands:
            cli.add_command(cmd)
