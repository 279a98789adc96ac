"""``composer-plugins env``: sample tasks from an env, score a completion, check the sandbox."""

from __future__ import annotations

import json
import sys

import click

from composer_plugins.core.cli import key_values


@click.group(name="env")
def env_group() -> None:
    """Work with envs: sample tasks, score completions, check the code sandbox."""


@env_group.command("sample")
@click.argument("name")
@click.option("-n", "--num", default=3, show_default=True, help="How many tasks.")
@click.option("--split", default="train", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("-S", "--set", "options", multiple=True, help="Env argument key=value (e.g. difficulty=2).")
@click.option("--json", "as_json", is_flag=True, help="Print the full task dicts as JSON lines.")
def sample_cmd(name: str, num: int, split: str, seed: int, options: tuple[str, ...], as_json: bool) -> None:
    """Print NUM tasks of env NAME."""
    from composer_plugins import build

    env = build("envs", name, **key_values(options, "--set"))
    try:
        for t in env.sample_tasks(num, split=split, seed=seed):
            if as_json:
                click.echo(json.dumps(t, default=str))
            else:
                click.echo(f"--- {t.get('task_id', '')}\n{t['prompt']}")
                for key in ("answer", "solution", "entry_point", "symbol"):
                    if key in t:
                        click.echo(f"[{key}] {t[key]}")
    finally:
        env.close()


@env_group.command("score")
@click.argument("name")
@click.option("--seed", default=0, show_default=True, help="Which task (sample_tasks(1, seed=SEED)).")
@click.option("--split", default="train", show_default=True)
@click.option("-S", "--set", "options", multiple=True, help="Env argument key=value.")
@click.option("--hint", "hint_provider", default="template", show_default=True, help="Hint provider name.")
@click.argument("completion_file", type=click.File("r"), default="-")
def score_cmd(name: str, seed: int, split: str, options: tuple[str, ...], hint_provider: str, completion_file) -> None:  # type: ignore[no-untyped-def]
    """Score a completion (from COMPLETION_FILE or stdin) on one task of env NAME; print feedback and hint."""
    from composer_plugins import build
    from composer_plugins.envs.hints import HintRequest, build_hint_provider

    env = build("envs", name, **key_values(options, "--set"))
    try:
        task = env.sample_tasks(1, split=split, seed=seed)[0]
        completion = completion_file.read()
        fb = env.score(completion, task)
        request = HintRequest(prompt=task["prompt"], completion=completion, feedback=fb, task=task, reward=fb.reward)
        hint = build_hint_provider(hint_provider, key="--hint").hint(request)
        out = {
            "task_id": task.get("task_id"),
            "reward": fb.reward,
            "kind": fb.kind,
            "message": fb.message,
            "hint": hint,
        }
        click.echo(json.dumps(out, indent=2))
    finally:
        env.close()


@env_group.command("sandbox-check")
def sandbox_check_cmd() -> None:
    """Show which sandbox isolation works on this machine and run a few escape attempts."""
    from composer_plugins.envs.sandbox import Sandbox, SandboxLimits, isolation_info

    info = isolation_info()
    click.echo(f"isolation: {info.mode} ({info.reason or 'namespaces unavailable'})")
    sb = Sandbox(SandboxLimits(wall_time_s=5))
    checks = {
        "network refused": "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
        "    print('FAIL')\nexcept OSError:\n    print('ok')",
        "home hidden": "import os\ntry:\n    print('ok' if not [n for n in os.listdir(os.path.expanduser('~'))"
        " if n.startswith('.ssh')] else 'FAIL')\nexcept OSError:\n    print('ok')",
        "secrets scrubbed": "import os\nprint('FAIL' if any('KEY' in k or 'TOKEN' in k for k in os.environ) else 'ok')",
    }
    failed = False
    for label, code in checks.items():
        ok = sb.run_code(code).stdout.strip().endswith("ok")
        failed |= not ok
        click.echo(f"  {'ok  ' if ok else 'FAIL'} {label}")
    sys.exit(1 if failed else 0)
