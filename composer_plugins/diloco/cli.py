"""``composer-plugins diloco`` (added by :mod:`.plugin`): validate the config once, then start the replicas where
``--executor`` says (a registered executor, :mod:`.executors`).
"""

from __future__ import annotations

import sys

import click

from composer_plugins.core.cli import set_option
from composer_plugins.diloco.launch import launch, summary_table


@click.command(name="diloco", context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]})
@click.option("--replicas", "-n", type=int, default=None, help="Replica groups (default: diloco.replicas or 2).")
@click.option("--config", "-c", "config", type=click.Path(dir_okay=False), help="Training config (YAML).")
@click.option("--section", default=None, help="Use this top-level key of the config file as the config.")
@click.option(
    "--target",
    default="train",
    show_default=True,
    help="What each replica trains: 'train' (the project's train config), 'toy' (built-in tiny LM) "
    "or 'module:function' taking the loaded Config.",
)
@click.option(
    "--executor",
    default="local",
    show_default=True,
    help="Where replicas run: local (processes here), hf_jobs (Hugging Face Jobs), modal (Modal functions) or "
    "another registered executor (composer-plugins list executors); the cloud ones need "
    "-S diloco.transport=object_store.",
)
@click.option("--lighthouse", help="Address of an existing torchft lighthouse (cluster); default: start one here.")
@click.option("--max-restarts", type=int, default=0, show_default=True, help="Restart a crashed replica.")
@click.option(
    "--warm-restarts",
    is_flag=True,
    help="local: fork restarted replicas from a process that has a replica's imports done (a fork server "
    "started beside the first replica), not a fresh interpreter: seconds sooner back in the rounds.",
)
@click.option("--log-dir", type=click.Path(file_okay=False), default="diloco_logs", show_default=True)
@click.option("--seed", type=int, default=None, help="Replica i gets seed + i (default: config seed + i).")
@click.option(
    "--first-index",
    type=int,
    default=0,
    show_default=True,
    help="Cluster: index of the first replica started on this node.",
)
@click.option("--total-replicas", type=int, default=None, help="Cluster: replicas in the whole job.")
@click.option(
    "--run-id",
    default=None,
    help="object_store: the run to start, join (several launchers with --first-index) or continue after the "
    "launcher died (default: diloco.run_id, else a new id; the launcher prints it).",
)
@click.option("--heartbeat-timeout-ms", type=int, default=5000, show_default=True)
@click.option("--join-timeout-ms", type=int, default=60000, show_default=True)
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Stop every replica and fail after this many seconds (default: no limit on the run itself).",
)
@set_option
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
def diloco_cmd(
    replicas: int | None,
    config: str | None,
    section: str | None,
    target: str,
    executor: str,
    lighthouse: str | None,
    max_restarts: int,
    warm_restarts: bool,
    log_dir: str,
    seed: int | None,
    first_index: int,
    total_replicas: int | None,
    run_id: str | None,
    heartbeat_timeout_ms: int,
    join_timeout_ms: int,
    timeout: float | None,
    set_overrides: tuple[str, ...],
    overrides: tuple[str, ...],
) -> None:
    """Train N DiLoCo replicas: torchft (lighthouse + one process group per replica here) or object_store.

    ``-S key=value`` (or positional OVERRIDES) are config overrides passed to every replica, e.g.
    ``-S diloco.sync_every=100``. Touch ``<log-dir>/STOP`` to stop all replicas after their next sync;
    Ctrl-C terminates them. Each replica writes ``<log-dir>/replica<i>.log`` and ``.sync.jsonl``.
    With ``-S diloco.transport=object_store -S diloco.store=URL`` the replicas meet only through the store,
    and ``--executor hf_jobs|modal`` runs them as cloud jobs.
    """
    from composer_plugins.core.config import Config
    from composer_plugins.diloco.run import check_replica_config

    overrides = (*overrides, *set_overrides)
    # every replica would read the same config: check it here, once, before any starts (and before the
    # executors and transports import torch, so a config error answers at once)
    dcfg = check_replica_config(target, config, overrides, section)
    from composer_plugins.diloco.executors import make_executor
    from composer_plugins.diloco.transports import get_transport

    if replicas is None:
        replicas = dcfg.replicas or 2
    if replicas < 1:
        raise Config().error("diloco.replicas", f"--replicas must be at least 1, got {replicas}.")
    transport = get_transport(dcfg.transport)
    transport.require(dcfg, dcfg.store)
    store = dcfg.store if transport.needs == "store" else None
    run_id = run_id or dcfg.run_id
    if run_id is not None:
        from dataclasses import replace

        replace(dcfg, run_id=run_id).validate(Config(), "diloco")  # the same rule as diloco.run_id
    several = first_index > 0 or (total_replicas is not None and total_replicas > first_index + replicas)
    if transport.needs == "store" and several and not run_id:
        raise Config().error(
            "diloco.run_id",
            "several launchers (--first-index/--total-replicas) join one run "
            "only under one id. HINT: pass the same --run-id <id> to every launcher.",
        )
    runner = make_executor(executor, dcfg, log_dir=log_dir, warm_restarts=warm_restarts)
    try:
        res = launch(
            replicas,
            target=target,
            config=config,
            overrides=overrides,
            section=section,
            lighthouse=lighthouse,
            max_restarts=max_restarts,
            log_dir=log_dir,
            base_seed=seed,
            index_offset=first_index,
            total_replicas=total_replicas,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            join_timeout_ms=join_timeout_ms,
            timeout=timeout,
            executor=runner,
            transport=dcfg.transport,
            store=store,
            run_id=run_id,
        )
    except KeyboardInterrupt:
        from composer_plugins.core.cli import report_interrupt
        from composer_plugins.core.errors import Interrupted
        from composer_plugins.diloco.store import redact_url

        if store is None:
            saved, then = f"all replicas terminated (their logs are in {log_dir})", "run it again to start over"
        else:
            saved = f"all replicas terminated; the run's global states are kept in {redact_url(store)}"
            then = f"continue it with the same command and --run-id {run_id or '<the run id printed above>'}"
        report_interrupt(Interrupted(saved, then))
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()
    for i, codes in sorted(res.exit_codes.items()):
        click.echo(f"replica {i}: exit codes {codes} (restarts {res.restarts[i]})")
    click.echo(summary_table(log_dir, [first_index + i for i in sorted(res.exit_codes)]))
    if not res.ok:
        click.secho(f"some replicas failed; see {log_dir}/replica<i>.log", err=True, fg="red")
        sys.exit(1)
