"""Stage implementations of the DVC pipeline that are not a feature's own command.

* :func:`prepare`: held-out and training tasks of every env of the study as JSONL
  (``data/tasks/<env>/{train,test}.jsonl``): the env's embedded seeded generator by default; for
  GSM8K also a Hugging Face dataset id or a local JSONL/JSON/parquet/CSV file in GSM8K format.
* :func:`rollout`: the SFT policy sampled on training tasks, scored by the env and written as
  OpenAI-messages traces (what ``composer-plugins replay`` reads).
* :func:`train_config`: the effective ``train`` config of one study cell (variant × seed).
* :func:`evaluate`: held-out metrics of one trained policy on every env (torchmetrics, via
  ``core.train.run_eval``), logged to MLflow with the DVC stage and git commit as tags.
* :func:`report`: metrics.json, DVC plot files and the ablation table over all study cells.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError
from composer_plugins.core.io import atomic_write_json, atomic_write_jsonl, read_jsonl
from composer_plugins.pipeline import study
from composer_plugins.training import tracking

SPLITS = ("train", "test")
#: Paths of the replay stage (relative to the repository root).
PATHS_REPLAY = {"traces": "data/traces.jsonl", "cache": "data/teacher_cache/cache.sqlite", "out": "data/replay"}


# ---------------------------------------------------------------------------------------
# small io helpers
# ---------------------------------------------------------------------------------------


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> int:
    """Write ``rows`` as JSONL atomically (parents created, keys sorted); returns the number of rows."""
    return atomic_write_jsonl(path, rows, sort_keys=True, default=str)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _section(params: Mapping[str, Any], key: str) -> dict[str, Any]:
    node = params.get(key)
    if node is None:
        return {}
    if not isinstance(node, Mapping):
        raise _error(params, key, f"must be a mapping, got {type(node).__name__}")
    return dict(node)


def _error(params: Mapping[str, Any], key: str, msg: str, valid: Sequence[str] | None = None) -> ConfigError:
    if isinstance(params, Config):
        return params.error(key, msg, valid)
    return ConfigError(msg, key=key, valid=valid)


# ---------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------

#: Keys of one ``data.<env>`` entry.
DATA_KEYS = ("env", "source", "train", "test", "hf_id", "hf_config", "path", "test_path", "seed")
SOURCES = ("embedded", "hf", "file")


def data_envs(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``data`` section as ``{env_key: settings}`` (``data.seed`` is the shared default seed)."""
    data = _section(params, "data")
    out: dict[str, dict[str, Any]] = {}
    for k, v in data.items():
        if k == "seed":
            continue
        if not isinstance(v, Mapping):
            raise _error(params, f"data.{k}", "expected a mapping like {train: 256, test: 64}")
        unknown = sorted(set(v) - set(DATA_KEYS))
        if unknown:
            raise _error(params, f"data.{k}.{unknown[0]}", "unknown key.", valid=DATA_KEYS)
        src = v.get("source", "embedded")
        if src not in SOURCES:
            raise _error(params, f"data.{k}.source", f"must be one of {', '.join(SOURCES)}, got {src!r}.")
        if src == "hf" and not v.get("hf_id"):
            raise _error(params, f"data.{k}.hf_id", "source: hf needs hf_id (e.g. openai/gsm8k).")
        if src == "file" and not v.get("path"):
            raise _error(params, f"data.{k}.path", "source: file needs path (a GSM8K-format .jsonl/.json/.parquet).")
        for split in SPLITS:
            n = v.get(split, 0)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise _error(params, f"data.{k}.{split}", f"must be an integer >= 0, got {n!r}.")
        out[str(k)] = {"seed": int(data.get("seed", 0)), **dict(v)}
    return out


def env_spec_for(params: Mapping[str, Any], key: str, settings: Mapping[str, Any] | None = None) -> Any:
    """The registry spec of env ``key``: ``settings['env']``, else ``data.<key>.env``, else ``train.env``
    when its name is ``key`` (so prepare, train and eval use one env configuration), else ``key``."""
    if settings and settings.get("env") is not None:
        return settings["env"]
    data_env = ((params.get("data") or {}).get(key) or {}).get("env")
    if data_env is not None:
        return data_env
    train_env = (params.get("train") or {}).get("env")
    if train_env is not None and _env_key(train_env) == key:
        return train_env
    return key


def source_spec(spec: Any, settings: Mapping[str, Any]) -> Any:
    """``spec`` with the env's ``source`` set from ``data.<env>`` (hf id or local file); unchanged if embedded."""
    src = settings.get("source", "embedded")
    if src == "embedded":
        return spec
    base: dict[str, Any] = {"name": spec} if isinstance(spec, str) else dict(spec)
    if src == "hf":
        base.update(source="hf", dataset_id=settings["hf_id"])
        if settings.get("hf_config"):
            base["dataset_config"] = settings["hf_config"]
    else:
        path = str(settings["path"])
        base["source"] = {"train": path, "test": str(settings["test_path"])} if settings.get("test_path") else path
    return base


def build_env(spec: Any) -> Any:
    """Build an env from its registry spec (``"gsm8k"`` or ``{"name": ..., **kwargs}``)."""
    from composer_plugins.core.config import build_component

    return build_component("envs", spec, key="env")


def sample_tasks(env: Any, n: int, split: str, seed: int) -> list[dict[str, Any]]:
    """``n`` seeded tasks of ``split`` from the env's generator (``sample_tasks`` or ``sample``)."""
    fn = getattr(env, "sample_tasks", None) or getattr(env, "sample", None)
    if fn is None:
        raise ConfigError(f"env {type(env).__name__} has no sample_tasks(n, split, seed); it cannot generate tasks")
    return [dict(t) for t in fn(n, split=split, seed=seed)]


def prepare(params: Mapping[str, Any], out_dir: str | os.PathLike[str] = "data/tasks") -> dict[str, Any]:
    """Write ``<out_dir>/<env>/{train,test}.jsonl`` for every env in ``params['data']``; returns the manifest.

    ``source: embedded`` draws ``n`` seeded tasks with the env's generator (train and test use
    different generator streams). ``source: hf`` / ``file`` hand the dataset id / path to the env
    (its loader validates the GSM8K format, naming file and line), shuffle the split with
    ``data.seed`` and keep ``n`` tasks (``0``: all of them).
    """
    out = Path(out_dir)
    manifest: dict[str, Any] = {"envs": {}}
    for key, s in data_envs(params).items():
        spec = source_spec(env_spec_for(params, key, s), s)
        env = build_env(spec)
        entry: dict[str, Any] = {"env": spec, "source": s.get("source", "embedded")}
        for split in SPLITS:
            n = int(s.get(split, 0))
            seed = int(s.get("seed", 0))
            if entry["source"] == "embedded":
                tasks = sample_tasks(env, n, split, seed) if n else []
            else:
                tasks = [dict(t) for t in env.tasks(split)]
                random.Random(seed).shuffle(tasks)
                tasks = tasks[:n] if n else tasks
            path = out / key / f"{split}.jsonl"
            write_jsonl(path, tasks)
            entry[split] = {"n": len(tasks), "path": path.as_posix(), "sha256": file_sha256(path)}
        if entry["train"]["n"] and entry["test"]["n"]:
            entry.update(split_overlap(out / key / "train.jsonl", out / key / "test.jsonl"))
        manifest["envs"][key] = entry
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def computation_of(task: Mapping[str, Any]) -> str | None:
    """What ``task`` computes: its solution's equations' operands and operators (``3*4;7+12``).

    ``None`` when the task states no equation (then only its prompt text can be compared).
    """
    from composer_plugins.envs.steps import computation_key

    text = task.get("solution") or task.get("target")
    if not isinstance(text, str):
        return None
    return computation_key(text) or None


def split_overlap(train: Path, test: Path) -> dict[str, Any]:
    """How much of ``test`` occurs in ``train``, by prompt text and by computed tuple.

    ``overlap``: test rows whose prompt is a train prompt; ``computation_overlap``: test rows whose
    computation (:func:`computation_of`) is one of train's, ``computation_overlap_distinct`` the
    distinct such computations; ``test_distinct`` / ``test_distinct_computations``: distinct test prompts
    and computations (a test row without equations counts by its prompt).
    """
    from composer_plugins.training.batches import task_prompt

    train_rows, test_rows = read_jsonl(train), read_jsonl(test)
    prompts = {task_prompt(t) for t in train_rows}
    comps = {c for c in map(computation_of, train_rows) if c}
    test_comps = [computation_of(t) or f"prompt:{task_prompt(t)}" for t in test_rows]
    shared = [c for c in test_comps if c in comps]
    return {
        "overlap": sum(task_prompt(t) in prompts for t in test_rows),
        "computation_overlap": len(shared),
        "computation_overlap_distinct": len(set(shared)),
        "test_distinct": len({task_prompt(t) for t in test_rows}),
        "test_distinct_computations": len(set(test_comps)),
        **line_overlap(train_rows, test_rows),
    }


def solution_lines(task: Mapping[str, Any]) -> list[str]:
    """The worked lines of a task's solution (stripped, without the ``#### answer`` line)."""
    text = task.get("solution") or task.get("target")
    if not isinstance(text, str):
        return []
    return [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.strip().startswith("####")]


def line_novelty(train_rows: Iterable[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> list[bool | None]:
    """Per test row: is its second worked line absent from every train solution? (``None``: it has no second line).

    The computation split keeps every test *tuple* out of train, yet a test line (``14 + 8 = 22``) may occur
    verbatim in train; a test row whose second line is new tests composition beyond recall of lines.
    """
    seen = {ln for t in train_rows for ln in solution_lines(t)}
    out: list[bool | None] = []
    for t in test_rows:
        lines = solution_lines(t)
        out.append(None if len(lines) < 2 else lines[1] not in seen)
    return out


def line_overlap(train_rows: Sequence[Mapping[str, Any]], test_rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many test rows' first line, second line and answer occur verbatim in train (any train line / answer).

    ``first_line_overlap`` / ``second_line_overlap`` count test rows whose first / second worked line is a line of
    some train solution; ``answer_overlap`` those whose answer is some train problem's; ``second_line_rows``
    the test rows that have a second line.
    """
    seen = {ln for t in train_rows for ln in solution_lines(t)}
    answers = {str(t.get("answer")) for t in train_rows if t.get("answer") is not None}
    lines = [solution_lines(t) for t in test_rows]
    return {
        "first_line_overlap": sum(bool(ls) and ls[0] in seen for ls in lines),
        "second_line_overlap": sum(len(ls) > 1 and ls[1] in seen for ls in lines),
        "second_line_rows": sum(len(ls) > 1 for ls in lines),
        "answer_overlap": sum(t.get("answer") is not None and str(t.get("answer")) in answers for t in test_rows),
    }


# ---------------------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------------------

ROLLOUT_KEYS = (
    "env",
    "num_prompts",
    "num_generations",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "batch_size",
    "max_prompt_length",
)


def rollout(
    params: Mapping[str, Any], model: str, tasks_path: str | os.PathLike[str], out: str | os.PathLike[str]
) -> dict[str, Any]:
    """Sample the policy at ``model`` on the first ``rollout.num_prompts`` tasks of ``tasks_path``.

    Writes one OpenAI-messages trace per completion (``{"id", "messages", "metadata"}``; the
    metadata holds the task fields, the env reward and ``correct``) and returns summary stats.
    """
    import torch

    from composer_plugins.models.generation import generate_completions
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.batches import env_rewards, task_prompt
    from composer_plugins.training.chat import install_chat_template, task_conversation

    r = _section(params, "rollout")
    unknown = sorted(set(r) - set(ROLLOUT_KEYS))
    if unknown:
        raise _error(params, f"rollout.{unknown[0]}", "unknown key.", valid=ROLLOUT_KEYS)
    env_spec = r.get("env") or (params.get("train") or {}).get("env") or "gsm8k"
    env = build_env(env_spec)
    env_name = _env_key(env_spec)
    tasks = read_jsonl(tasks_path)[: int(r.get("num_prompts", 32))]
    if not tasks:
        raise _error(params, "rollout.num_prompts", f"no tasks in {tasks_path}")
    G = int(r.get("num_generations", 2))
    bs = max(1, int(r.get("batch_size", 16)))
    seed = int(r.get("seed", 0))
    thr = float(((params.get("train") or {}).get("rollout") or {}).get("success_threshold", 1.0))
    torch.manual_seed(seed)
    policy, tok = load_policy(model)
    chat = str((((params.get("train") or {}).get("model")) or {}).get("chat_template", "auto"))
    install_chat_template(tok, chat)
    rows: list[dict[str, Any]] = []
    rewards: list[float] = []
    import sys

    report_every = max(bs, -(-len(tasks) // 4 // bs) * bs)  # about four progress lines (a log, not a bar)
    for b0 in range(0, len(tasks), bs):
        if b0 and b0 % report_every == 0:
            print(f"rollout: {b0}/{len(tasks)} prompts", file=sys.stderr, flush=True)
        chunk = tasks[b0 : b0 + bs]
        ro = generate_completions(
            policy,
            tok,
            [task_prompt(t, tok, chat) for t in chunk],
            G,
            max_new_tokens=int(r.get("max_new_tokens", 48)),
            temperature=float(r.get("temperature", 1.0)),
            top_p=float(r.get("top_p", 1.0)),
            top_k=int(r.get("top_k", 0)),
            seed=seed * 100_003 + b0,
            max_prompt_length=r.get("max_prompt_length"),
        )
        rs = env_rewards(env, chunk, ro.completions, G, unscorable=0.0)  # traces: unscorable = not correct
        for j, (comp, rew) in enumerate(zip(ro.completions, rs, strict=True)):
            i = b0 + j // G
            task = tasks[i]
            meta = {k: v for k, v in task.items() if k not in ("prompt", "question")}
            meta.update(task_index=i, sample=j % G, reward=rew, correct=rew >= thr, env=env_name)
            rows.append(
                {
                    "id": f"{env_name}-{i}-{j % G}",
                    "messages": [
                        *(task_conversation(task) or [{"role": "user", "content": task_prompt(task)}]),
                        {"role": "assistant", "content": comp},
                    ],
                    "metadata": meta,
                }
            )
            rewards.append(rew)
    write_jsonl(out, rows)
    stats = {
        "traces": len(rows),
        "prompts": len(tasks),
        "reward_mean": sum(rewards) / len(rewards),
        "accuracy": sum(x >= thr for x in rewards) / len(rewards),
    }
    atomic_write_json(Path(str(out) + ".stats.json"), stats)
    return stats


# ---------------------------------------------------------------------------------------
# replay: the `composer-plugins replay run` config of the replay stage
# ---------------------------------------------------------------------------------------


def replay_config(
    params: Mapping[str, Any],
    traces: str = PATHS_REPLAY["traces"],
    cache: str = PATHS_REPLAY["cache"],
    out_dir: str = PATHS_REPLAY["out"],
) -> dict[str, Any]:
    """The ``replay run`` config of the replay stage: ``params['replay']`` plus the pipeline's paths.

    The stage fills the teacher cache (``cache``, a persistent DVC output) and writes the raw
    responses and a summary; agreement-k extraction and normalisation are the ``pairs`` stage,
    whose ``pairs.k`` / ``pairs.compare`` are the one consensus setting (the raw pairs use it too).
    """
    r = _section(params, "replay")
    if not r.get("teachers"):
        raise _error(params, "replay.teachers", "at least one teacher is required (e.g. [{name: oracle}])")
    p = _section(params, "pairs")
    out = Path(out_dir)
    return {
        **r,
        "consensus": {"k": int(p.get("k", 2)), "compare": p.get("compare", "text")},
        "run_id": r.get("run_id") or "pipeline-replay",
        "traces": [traces],
        "cache": {**(r.get("cache") or {}), "path": cache},
        "normalize": {"enabled": False},
        "output": {
            "pairs": (out / "raw_pairs.jsonl").as_posix(),
            "responses": (out / "responses.jsonl").as_posix(),
            "summary": (out / "summary.json").as_posix(),
        },
    }


# ---------------------------------------------------------------------------------------
# pairs: agreement-k extraction + data-juicer normalisation from the teacher cache
# ---------------------------------------------------------------------------------------

PAIRS_KEYS = ("k", "compare", "normalize", "recipe")


def pairs(
    params: Mapping[str, Any],
    traces: str | os.PathLike[str],
    cache: str | os.PathLike[str],
    out: str | os.PathLike[str],
) -> dict[str, Any]:
    """Preference pairs from the replay stage's teacher cache, without paying for any call.

    The teachers of ``replay.teachers`` are replayed over ``traces`` against a copy of ``cache``
    (the replay stage's output stays byte-identical) with a zero budget, so every answer comes
    from the cache: a paid teacher whose answer is missing is refused, never called; free local
    teachers such as ``oracle`` simply answer. Then agreement-k extraction (``pairs.k``,
    ``pairs.compare``) and, if ``pairs.normalize``, the data-juicer recipe (``pairs.recipe`` or
    the shipped one). Writes ``out`` and ``<out stem>.stats.json``.
    """
    from composer_plugins.core.config import Config as _Config
    from composer_plugins.core.config import resolve_env
    from composer_plugins.teachers.runner import parse_config, run_replay

    p = _section(params, "pairs")
    unknown = sorted(set(p) - set(PAIRS_KEYS))
    if unknown:
        raise _error(params, f"pairs.{unknown[0]}", "unknown key.", valid=PAIRS_KEYS)
    replay = _section(params, "replay")
    if not replay.get("teachers"):
        raise _error(params, "replay.teachers", "at least one teacher is required (e.g. [{name: oracle}])")
    lines = {k[len("replay.") :]: v for k, v in getattr(params, "lines", {}).items() if k.startswith("replay.")}
    rc_data = {
        **{k: v for k, v in replay.items() if k not in ("output", "normalize", "consensus", "cache", "budget")},
        "traces": [str(traces)],
        "consensus": {"k": int(p.get("k", 2)), "compare": p.get("compare", "text")},
        "cache": {"path": str(cache)},
        "budget": {"max_usd": 0.0, "fresh": True, "durable_reservations": False},
        "normalize": {
            "enabled": bool(p.get("normalize", True)),
            **({"recipe": p["recipe"]} if p.get("recipe") else {}),
        },
        "output": {"pairs": str(out)},
        "run_id": "pipeline-pairs",
        "progress": False,
    }
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pairs-cache-") as td:
        # Work on a copy: the replay stage's cache is its DVC output and must stay byte-identical
        # (the engine writes a spend ledger and a lock file next to the database).
        if Path(cache).exists():
            shutil.copy2(cache, Path(td) / "cache.sqlite")
        rc_data["cache"] = {"path": str(Path(td) / "cache.sqlite")}
        src = _Config(rc_data, getattr(params, "source", None), lines)
        resolve_env(src, src)  # `{$env: NAME}` teacher settings, resolved only here and never written out
        rc = parse_config(src)
        summary = run_replay(rc, src)
    stats_path = Path(out).with_suffix(".stats.json")
    atomic_write_json(stats_path, summary, sort_keys=True, default=str)
    return summary


# ---------------------------------------------------------------------------------------
# study cells: effective train config, evaluation
# ---------------------------------------------------------------------------------------

#: Where each stage writes (relative to the repository root).
PATHS = {
    "data": "data/tasks",
    "sft_model": "models/sft/model",
    "traces": "data/traces.jsonl",
    "pairs": "data/pairs.jsonl",
    "runs": "runs",
    "evals": "evals",
}


def train_config(
    params: Mapping[str, Any],
    variant: str | None,
    seed: int,
    *,
    pairs: str | None = PATHS["pairs"],
    model: str = PATHS["sft_model"],
    data_dir: str = PATHS["data"],
    runs_dir: str = PATHS["runs"],
) -> dict[str, Any]:
    """The effective ``train`` config (plain dict) of study cell ``variant × seed``.

    ``params['train']`` deep-merged with ``study.variants.<variant>``, then the pipeline's
    wiring: start from the SFT stage's model (SFT off), the prepared GSM8K files, the pairs of
    the replay stage, ``seed``, ``output_dir=runs/<variant>-s<seed>``, and MLflow settings/tags.
    """
    base = _section(params, "train")
    # merge_params: a variant replaces a mapping it marks `_replace: true` (e.g. another hints.provider)
    cfg = study.merge_params(base, study.variant_overrides(params, variant)) if variant else study.deep_merge(base, {})
    name = study.run_name(variant, seed) if variant else "sft"
    env_key = _env_key(cfg.get("env", "gsm8k"))
    data = dict(cfg.get("data") or {})
    train_file = Path(data_dir) / env_key / "train.jsonl"
    test_file = Path(data_dir) / env_key / "test.jsonl"
    data.setdefault("train_path", train_file.as_posix())
    data.setdefault("test_path", test_file.as_posix())
    cfg["data"] = data
    cfg["seed"] = int(seed)
    cfg["output_dir"] = (Path(runs_dir) / name).as_posix()
    cfg["model"] = {**(cfg.get("model") or {}), "name_or_path": model}
    cfg["sft"] = {**(cfg.get("sft") or {}), "enabled": False}
    if pairs is not None:  # a variant may name its own pairs file (study.variants.<v>.replay.pairs_path)
        own = ((study.variant_overrides(params, variant).get("replay") or {}) if variant else {}).get("pairs_path")
        cfg["replay"] = {**(cfg.get("replay") or {}), "pairs_path": own or pairs}
    flags = channel_flags(cfg)
    ml = _section(params, "mlflow")
    cfg["mlflow"] = {
        **(cfg.get("mlflow") or {}),
        "enabled": tracking.mlflow_enabled(params),
        "tracking_uri": ml.get("tracking_uri", "sqlite:///mlflow.db"),
        "experiment": tracking.experiment_name(params),
        "run_name": f"train@{name}",
        "tags": {
            **((cfg.get("mlflow") or {}).get("tags") or {}),
            tracking.TAG_VARIANT: variant or "sft",
            tracking.TAG_SEED: str(seed),
            "study.channels": channels_label(flags),
        },
    }
    return cfg


def train_cell(
    params: Mapping[str, Any],
    variant: str,
    seed: int,
    *,
    pairs: str | None = PATHS["pairs"],
    model: str = PATHS["sft_model"],
) -> dict[str, Any]:
    """Write the cell's ``config.yaml`` and train it (DiLoCo when ``train.diloco.replicas > 1``).

    Returns the final train metrics. The cell's directory ends up with ``config.yaml``,
    ``model/``, ``history.csv`` and ``metrics.json`` either way.
    """
    import shutil

    import yaml

    if pairs is not None and (not Path(pairs).exists() or Path(pairs).stat().st_size == 0):
        pairs = None  # no pairs (e.g. every student trace agreed with the teachers): replay channel is skipped
    cfg = train_config(params, variant, seed, pairs=pairs, model=model)
    out = Path(cfg["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    header = f"# generated by `composer-plugins study train --variant {variant} --seed {seed}`\n"
    cfg_path.write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    replicas = int((cfg.get("diloco") or {}).get("replicas") or 1)
    if replicas <= 1:
        from composer_plugins.training.config import load_train_config
        from composer_plugins.training.run import run_train

        tc, src = load_train_config(cfg_path)
        print(f"composer-plugins train -c {cfg_path}", flush=True)
        return dict(run_train(tc, src).metrics)
    from composer_plugins.diloco.launch import launch

    print(f"composer-plugins diloco --replicas {replicas} -c {cfg_path} --seed {seed}", flush=True)
    res = launch(replicas, target="train", config=str(cfg_path), log_dir=str(out / "diloco_logs"), base_seed=seed)
    if not res.ok:
        raise ConfigError(f"DiLoCo training failed (exit codes {res.exit_codes}); see {out}/diloco_logs/replica<i>.log")
    r0 = out / "replica0"
    for name in ("model", "history.csv", "metrics.json"):
        src_p, dst = r0 / name, out / name
        if src_p.is_dir():
            shutil.copytree(src_p, dst, dirs_exist_ok=True)
        elif src_p.exists():
            shutil.copy2(src_p, dst)
    return json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}


def _env_key(spec: Any) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return str(spec.get("name") or "env")
    return "env"


def channel_flags(train_cfg: Mapping[str, Any]) -> dict[str, bool]:
    """``{channel_key: on}`` for ``train.losses`` (on = enabled and weight != 0; ``training.config.channel_spec``)."""
    from composer_plugins.training.loss_specs import channel_spec, losses_mapping

    losses = losses_mapping(train_cfg.get("losses"), pre="train.") or {}
    return {k: channel_spec(k, spec, pre="train.").active for k, spec in losses.items()}


def channels_label(flags: Mapping[str, bool]) -> str:
    """``grpo+hint_distill+replay`` (channels on, in config order) or ``none``."""
    on = [k for k, v in flags.items() if v]
    return "+".join(on) if on else "none"


EVAL_KEYS = ("envs", "max_new_tokens", "batch_size", "seed", "hint_uplift", "hint_uplift_samples")


def eval_envs(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``eval.envs`` as ``{env_key: overrides of the train config's eval section}``."""
    e = _section(params, "eval")
    unknown = sorted(set(e) - set(EVAL_KEYS))
    if unknown:
        raise _error(params, f"eval.{unknown[0]}", "unknown key.", valid=EVAL_KEYS)
    envs = e.get("envs") or {"gsm8k": {}}
    if not isinstance(envs, Mapping):
        raise _error(params, "eval.envs", "must map env keys to settings, e.g. {gsm8k: {num_problems: 64}}")
    return {str(k): dict(v or {}) for k, v in envs.items()}


#: The metric each env contributes to the headline table (``<env>/<metric>`` from ``run_eval``).
HEADLINE_ALIASES = {
    "gsm8k/accuracy": ("gsm8k/accuracy",),
    "code/pass_at_1": ("code/pass_at_1", "code/accuracy"),
    "feature_deletion/mean_reward": ("feature_deletion/mean_reward",),
}


def evaluate(
    params: Mapping[str, Any],
    variant: str | None,
    seed: int,
    model: str,
    out: str | os.PathLike[str],
    *,
    data_dir: str = PATHS["data"],
    history: str | os.PathLike[str] | None = None,
    train_metrics: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` on the held-out split of every ``eval.envs`` entry; write ``out`` (JSON).

    ``variant=None`` evaluates the SFT start (the study's baseline row). Logs one MLflow run
    (tags: DVC stage, git commit, variant, seed; params: the effective train config and
    ``study.*``; metrics: held-out and final train metrics; artifacts: the result JSON and the
    training curves).
    """
    from composer_plugins.training.config import train_config_from_dict
    from composer_plugins.training.run import run_eval

    name = study.run_name(variant, seed) if variant else "sft"
    cfg = train_config(params, variant, seed)
    flags = channel_flags(cfg) if variant else dict.fromkeys(channel_flags(cfg), False)
    import tempfile

    ev = _section(params, "eval")
    metrics: dict[str, float] = {}
    correct: dict[str, str] = {}
    for env_key, settings in eval_envs(params).items():
        c = json.loads(json.dumps(cfg))
        c["env"] = env_spec_for(params, env_key, settings)
        settings.pop("env", None)
        c["data"] = {**c["data"], "test_path": (Path(data_dir) / env_key / "test.jsonl").as_posix()}
        e = {**(c.get("eval") or {}), "at_start": False, "at_end": False}
        for k in ("max_new_tokens", "batch_size", "seed", "hint_uplift", "hint_uplift_samples"):
            if k in ev:
                e[k] = ev[k]
        e.update(settings)
        c["eval"] = e
        c["eval"]["predictions"] = True  # per-problem correctness: committed, and split by line novelty
        tc = train_config_from_dict(c)
        with tempfile.TemporaryDirectory(prefix="eval-") as td:
            res = run_eval(tc, checkpoint=model, output=f"{td}/eval.json")
            preds = read_jsonl(f"{td}/eval.predictions.jsonl")
        metrics.update(
            {f"{env_key}/{k.split('/', 1)[1]}" if "/" in k else f"{env_key}/{k}": float(v) for k, v in res.items()}
        )
        correct[env_key] = "".join("1" if p.get("correct") else "0" for p in preds)
        train_file = Path(data_dir) / env_key / "train.jsonl"
        if train_file.exists() and preds:
            metrics.update(novelty_accuracy(read_jsonl(train_file), preds, env_key))
    for head, aliases in HEADLINE_ALIASES.items():
        for a in aliases:
            if a in metrics:
                metrics.setdefault(head, metrics[a])
                break
    if train_metrics and Path(train_metrics).exists():
        tm = json.loads(Path(train_metrics).read_text())
        metrics.update(
            {
                study.canonical_metric(k): float(v)
                for k, v in tm.items()
                if k.startswith(("train/", "sft/")) and _is_num(v)
            }
        )
    result = {
        "run": name,
        "variant": variant or "sft",
        "seed": seed,
        "channels": channels_label(flags),
        "channel_flags": flags,
        "model": str(model),
        "metrics": metrics,
        "correct": correct,  # per env, one character per held-out problem in test.jsonl order (1: solved greedily)
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result, sort_keys=True)
    run_id = log_eval_run(params, cfg, result, artifacts=[out, *([history] if history else [])])
    if run_id:
        result["mlflow_run_id"] = run_id
    return result


def novelty_accuracy(
    train_rows: Sequence[Mapping[str, Any]], predictions: Sequence[Mapping[str, Any]], env_key: str
) -> dict[str, float]:
    """Greedy accuracy split by line novelty (:func:`line_novelty`): ``<env>/accuracy_unseen_line`` on the problems
    whose second worked line never occurs in train (the composition headline), ``accuracy_seen_line`` on the rest,
    with their counts ``n_unseen_line`` / ``n_seen_line``."""
    novel = line_novelty(train_rows, predictions)
    out: dict[str, float] = {}
    for name, want in (("unseen", True), ("seen", False)):
        rows = [p for p, nv in zip(predictions, novel, strict=True) if nv is want]
        out[f"{env_key}/n_{name}_line"] = float(len(rows))
        if rows:
            out[f"{env_key}/accuracy_{name}_line"] = sum(bool(p.get("correct")) for p in rows) / len(rows)
    return out


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def log_eval_run(
    params: Mapping[str, Any],
    train_cfg: Mapping[str, Any],
    result: Mapping[str, Any],
    artifacts: Sequence[str | os.PathLike[str]] = (),
) -> str | None:
    """Log one evaluation into the study's MLflow experiment; returns the run id (``None`` when off)."""
    if not tracking.mlflow_enabled(params):
        return None
    from composer_plugins.core.config import redact

    uri = tracking.tracking_uri(params)
    client = tracking.client(uri)
    exp_id = tracking.ensure_experiment(client, tracking.experiment_name(params), uri)
    tags = tracking.run_tags(
        variant=str(result["variant"]), seed=int(result["seed"]), extra={"study.channels": result["channels"]}
    )
    if tags[tracking.TAG_STAGE] == "manual":
        tags[tracking.TAG_STAGE] = f"eval@{result['run']}"
    from composer_plugins.core.errors import ComposerPluginsError
    from composer_plugins.training.builders import config_components
    from composer_plugins.training.config import train_config_from_dict

    try:  # provenance of the evaluated config's env and channels; the eval itself never depends on it
        tags.update(tracking.provenance_tags(config_components(train_config_from_dict(train_cfg))))
    except ComposerPluginsError:
        pass
    run = client.create_run(exp_id, run_name=tracking.run_name(f"eval@{result['run']}"), tags=tags)
    rid = run.info.run_id
    try:
        flat = {f"train.{k}": v for k, v in tracking.flatten(redact(dict(train_cfg))).items()}
        flat.update(
            {
                "study.variant": result["variant"],
                "study.seed": result["seed"],
                "study.channels": result["channels"],
                **{f"study.channel.{k}": "on" if v else "off" for k, v in result["channel_flags"].items()},
            }
        )
        from mlflow.entities import Metric, Param

        items = [Param(k[:250], str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            client.log_batch(rid, params=items[i : i + 100])
        ms = [Metric(_mlflow_key(k), float(v), 0, 0) for k, v in result["metrics"].items()]
        for i in range(0, len(ms), 500):
            client.log_batch(rid, metrics=ms[i : i + 500])
        for a in artifacts:
            if a and Path(a).exists():
                client.log_artifact(rid, str(a))
        client.set_terminated(rid, "FINISHED")
    except Exception:
        client.set_terminated(rid, "FAILED")
        raise
    return rid


def _mlflow_key(k: str) -> str:
    # metric names are MLflow-safe already (docs/metrics.md); old spellings are mapped onto them
    return study.canonical_metric(k)


def unmlflow_key(k: str) -> str:
    """A metric name read back from MLflow (or an old file) in the one naming scheme (docs/metrics.md)."""
    return study.canonical_metric(k)


# ---------------------------------------------------------------------------------------
# report: metrics.json, plots, ablation table
# ---------------------------------------------------------------------------------------


def collect(evals_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every ``<evals_dir>/*.json`` written by :func:`evaluate`, flattened to ablation records."""
    recs = []
    for p in sorted(Path(evals_dir).glob("*.json")):
        d = json.loads(p.read_text())
        rec = {"run": d["run"], "variant": d["variant"], "seed": d["seed"], "channels": d["channels"]}
        rec.update({study.canonical_metric(k): v for k, v in d["metrics"].items()})
        recs.append(rec)
    return recs


def report(
    params: Mapping[str, Any],
    evals_dir: str | os.PathLike[str] = PATHS["evals"],
    runs_dir: str | os.PathLike[str] = PATHS["runs"],
    metrics_out: str | os.PathLike[str] = "metrics.json",
    plots_dir: str | os.PathLike[str] = "plots",
    table_out: str | os.PathLike[str] = "results/ablation.md",
) -> dict[str, Any]:
    """Aggregate every study cell: ``metrics.json`` (per variant mean/std), plots and the ablation table."""
    recs = collect(evals_dir)
    if not recs:
        raise ConfigError(f"no evaluation results in {evals_dir}/; run the eval stages first")
    order = {"sft": -1, **{v: i for i, v in enumerate(study.variants(params))}}
    recs.sort(key=lambda r: (order.get(r["variant"], len(order)), r["variant"], r["seed"]))
    metrics_names = [m for m in study.HEADLINE_METRICS if any(m in r for r in recs)]
    rows = study.ablation_rows(recs, metrics_names, group_by=("variant", "channels"))
    # metrics.json: {variant: {metric: {mean, std}}, ...} (flattened by DVC as variant.metric.mean)
    out: dict[str, Any] = {}
    for row in rows:
        out[row["variant"]] = {
            "n": row["n"],
            **{m: {"mean": _r(row[m][0]), "std": _r(row[m][1])} for m in metrics_names},
        }
    Path(metrics_out).parent.mkdir(parents=True, exist_ok=True)
    # plots: one bar per variant for the headline metric, and the curves of every run (long format)
    pdir = Path(plots_dir)
    pdir.mkdir(parents=True, exist_ok=True)
    with (pdir / "ablation.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "channels", "n", *[f"{m}" for m in metrics_names], *[f"{m} std" for m in metrics_names]])
        for row in rows:
            w.writerow(
                [
                    row["variant"],
                    row["channels"],
                    row["n"],
                    *[_r(row[m][0]) for m in metrics_names],
                    *[_r(row[m][1]) for m in metrics_names],
                ]
            )
    write_curves(Path(runs_dir), pdir / "train_curves.csv", pdir / "curves")
    table = study.format_table(rows, metrics_names, group_by=("variant", "channels"))
    header = "# Ablation: loss channels on/off × seeds (held-out, mean ± sample std over seeds)\n\n"
    study.write_text(table_out, header + table + "\n")
    paired_text = _paired_report(params, out, evals_dir, runs_dir, metrics_names)
    atomic_write_json(metrics_out, out, sort_keys=True)
    paired_out = Path(table_out).with_name("paired.md")
    study.write_text(paired_out, paired_text)
    _log_report(params, out, [metrics_out, table_out, paired_out, pdir])
    return {"metrics": out, "table": table, "rows": rows, "paired": paired_text}


#: The per-step training curve whose run mean metrics.json and the paired table carry per variant.
SIGNAL = "train/groups_with_signal"
#: Per-step columns whose run mean (mean/std over seeds) metrics.json carries per variant.
RUN_MEANS = (SIGNAL, "train/hint/teacher_margin", "train/hint/fraction", "train/reward")


def _paired_report(
    params: Mapping[str, Any],
    out: dict[str, Any],
    evals_dir: str | os.PathLike[str],
    runs_dir: str | os.PathLike[str],
    metrics_names: Sequence[str],
) -> str:
    """Add ``train/groups_with_signal`` and the paired effects against ``study.baseline`` to ``out``.

    ``out`` is metrics.json's ``{variant: {...}}``: each variant gets the run mean of
    ``train/groups_with_signal`` (mean/std over seeds) and, when ``study.baseline`` names a variant,
    ``paired_vs_<baseline>``: ``{metric: {diff, se, low, high}}`` (per-seed differences, Student t 95%
    interval; :mod:`.paired`). Returns the markdown of ``results/paired.md``.
    """
    from composer_plugins.pipeline import paired

    recs, hist = paired.read_study_dir(".", evals_dir, runs_dir)
    signal = paired.run_means(hist, SIGNAL)
    for col in RUN_MEANS:  # run means over steps, mean/std over seeds
        for v, by_seed in (signal if col == SIGNAL else paired.run_means(hist, col)).items():
            if v in out:
                mean, std = study.mean_std(list(by_seed.values()))
                out[v][col] = {"mean": _r(mean), "std": _r(std)}
    base = study.baseline(params)
    title = "# Paired effects: each variant minus the baseline, per seed (docs/results.md)\n\n"
    if base is None:
        return title + "No paired baseline: set `study.baseline` to a variant of `study.variants`.\n"
    names = [v for v in study.variants(params) if v != base]
    metric = metrics_names[0] if metrics_names else "gsm8k/accuracy"
    for m in [*metrics_names, SIGNAL]:
        table = signal if m == SIGNAL else paired.by_variant_seed(recs, m)
        if base not in table or m == metric:
            continue
        for v in names:
            if v in table and v in out:
                e = paired.paired_effect(table[v], table[base], name=v, baseline_name=base, metric=m)
                out[v].setdefault(f"paired_vs_{base}", {})[m] = {
                    "diff": _r(e.mean),
                    "se": _r(e.se),
                    "low": _r(e.low),
                    "high": _r(e.high),
                    "p": _r(e.p),
                }
    delta = study.threshold_delta(params)
    sft = [r for r in recs if r["variant"] == "sft"]
    start = sft[0].get(metric) if sft else None
    # the report's family of tests (final accuracy, signal, curve), Holm-corrected together
    for part, effects in paired.study_effects(recs, hist, base, metric, delta=delta, start=start).items():
        for e in effects:
            if e.variant not in out:
                continue
            key = metric if part == "final" else SIGNAL if part == "signal" else "curve/" + e.metric.split(" ", 1)[1]
            row = {
                "diff": _r(e.mean),
                "se": _r(e.se),
                "low": _r(e.low),
                "high": _r(e.high),
                "p": _r(e.p),
                "p_holm": _r(e.p_adjusted),
                "variant_mean": _r(e.variant_mean),
                "baseline_mean": _r(e.baseline_mean),
            }
            row.update({k: (_r(x) if isinstance(x, float) else x) for k, x in e.extra.items()})
            out[e.variant].setdefault(f"paired_vs_{base}", {})[key] = row
    heldout_n = eval_envs(params).get("gsm8k", {}).get("num_problems")
    fractions = sorted(
        {
            c
            for by_seed in hist.values()
            for rows in by_seed.values()
            for r in rows
            for c in r
            if c.startswith(FRACTION_COLUMNS)
        }
    )
    gap_file = Path(GAP_FILE)  # `composer-plugins study gap` (before RL), when it was run
    gap = json.loads(gap_file.read_text()) if gap_file.exists() else None
    text = paired.study_report(
        ".",
        base,
        metric,
        heldout_n=heldout_n,
        evals=evals_dir,
        runs=runs_dir,
        delta=delta,
        fractions=fractions,
        gap=gap,
    )
    return title + text + "\n"


#: The gap predictor's result (``composer-plugins study gap``), read by the report when present.
GAP_FILE = "results/gap.json"


#: Per-step history columns of each channel's active-row fraction (the paired report lists their run means).
FRACTION_COLUMNS = ("train/hint/fraction", "train/teacher_distill/fraction", "train/grpo/fraction")


def _r(v: Any) -> Any:
    if v is None:
        return None
    v = float(v)
    return None if v != v else round(v, 6)


#: ``history.csv`` columns plotted per step (docs/metrics.md names): the run's totals, then each
#: channel's ``loss`` and ``pairs`` (a third-party channel's columns match the same patterns).
CURVE_PATTERNS: tuple[str, ...] = (
    "train/reward",
    "train/loss",
    "train/accuracy",
    "train/groups_with_signal",
    "train/hint/rows",
    "train/hint/fraction",
    "train/hint/teacher_margin",
    "train/heldout/accuracy",
    "train/*/loss",
    "train/*/pairs",
)


def curve_columns(columns: Iterable[str]) -> list[str]:
    """The columns of :data:`CURVE_PATTERNS` among ``columns`` (full names), in pattern order."""
    import fnmatch

    cols = list(dict.fromkeys(columns))
    out: list[str] = []
    for pat in CURVE_PATTERNS:
        out += [c for c in cols if c not in out and fnmatch.fnmatchcase(c, pat) and c.count("/") == pat.count("/")]
    return out


def curve_file(metric: str) -> str:
    """``train/grpo/loss`` -> ``train.grpo.loss.csv`` (one file per curve under ``plots/curves/``)."""
    return metric.replace("/", ".") + ".csv"


def write_curves(runs_dir: Path, out: Path, curves_dir: Path | None = None) -> int:
    """Per-step curves of every run for DVC plots; returns the number of rows of ``out``.

    ``out`` (``plots/train_curves.csv``) is the long table ``step, run, variant, seed`` + every
    curve column; ``curves_dir`` (``plots/curves/``) gets one ``<metric>.csv`` per curve
    (``step, run, variant, seed, <metric>``), which dvc.yaml plots as a directory: a channel that
    logs ``<channel>/loss`` gets its plot without any change to dvc.yaml. Reads
    ``<runs_dir>/<variant>-s<seed>/history.csv`` (old unprefixed columns are read under their current names).
    """
    rows: list[dict[str, Any]] = []
    seen: list[str] = []
    for hist in sorted(runs_dir.glob("*/history.csv")):
        name = hist.parent.name
        try:
            variant, seed = study.parse_run_name(name)
        except ValueError:
            variant, seed = name, -1
        with hist.open() as f:
            for r in csv.DictReader(f):
                vals = {study.history_column(k): v for k, v in r.items() if k}
                seen += [k for k in vals if k not in seen]
                row: dict[str, Any] = {"step": int(float(vals["step"])), "run": name, "variant": variant, "seed": seed}
                row.update({k: _r(v) for k, v in vals.items() if k != "step" and v not in ("", None)})
                rows.append(row)
    cols = curve_columns(seen)
    keys = ["step", "run", "variant", "seed"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*keys, *cols], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    if curves_dir is not None:
        import shutil

        if curves_dir.exists():
            shutil.rmtree(curves_dir)  # a channel switched off must not leave a stale curve behind
        curves_dir.mkdir(parents=True)
        for col in cols:
            with (curves_dir / curve_file(col)).open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=[*keys, col], extrasaction="ignore")
                w.writeheader()
                w.writerows(r for r in rows if r.get(col) is not None)
    return len(rows)


def _log_report(params: Mapping[str, Any], metrics: Mapping[str, Any], artifacts: Sequence[Any]) -> str | None:
    if not tracking.mlflow_enabled(params):
        return None
    uri = tracking.tracking_uri(params)
    client = tracking.client(uri)
    exp_id = tracking.ensure_experiment(client, tracking.experiment_name(params), uri)
    tags = tracking.run_tags()
    if tags[tracking.TAG_STAGE] == "manual":
        tags[tracking.TAG_STAGE] = "report"
    run = client.create_run(exp_id, run_name=tracking.run_name("report"), tags=tags)
    rid = run.info.run_id
    from mlflow.entities import Metric

    flat = tracking.flatten(metrics, sep="/")
    client.log_batch(rid, metrics=[Metric(_mlflow_key(k), float(v), 0, 0) for k, v in flat.items() if _is_num(v)])
    for a in artifacts:
        p = Path(a)
        if p.is_dir():
            client.log_artifacts(rid, str(p), artifact_path=p.name)
        elif p.exists():
            client.log_artifact(rid, str(p))
    client.set_terminated(rid, "FINISHED")
    return rid
