"""The DVC stages' public names in one place: each stage lives in its own module, re-exported here.

``composer_plugins/pipeline/``: :mod:`.common` (paths, JSONL, located params errors), :mod:`.stage_prepare`
(tasks and the split's tuple- and line-level overlap), :mod:`.stage_rollout` (student traces),
:mod:`.stage_replay` (the replay run's config), :mod:`.stage_pairs` (agreement-k pairs), :mod:`.stage_train`
(one study cell's config and run), :mod:`.stage_eval` (held-out metrics, MLflow), :mod:`.stage_report`
(metrics.json, plot files, ablation and paired tables).
"""

from composer_plugins.pipeline.common import PATHS, PATHS_REPLAY, SPLITS, file_sha256, write_jsonl
from composer_plugins.pipeline.stage_eval import (
    EVAL_KEYS,
    HEADLINE_ALIASES,
    eval_envs,
    evaluate,
    log_eval_run,
    novelty_accuracy,
    unmlflow_key,
)
from composer_plugins.pipeline.stage_pairs import PAIRS_KEYS, pairs
from composer_plugins.pipeline.stage_prepare import (
    DATA_KEYS,
    SOURCES,
    build_env,
    computation_of,
    data_envs,
    env_spec_for,
    line_novelty,
    line_overlap,
    prepare,
    sample_tasks,
    solution_lines,
    source_spec,
    split_overlap,
)
from composer_plugins.pipeline.stage_replay import replay_config
from composer_plugins.pipeline.stage_report import (
    CURVE_PATTERNS,
    FRACTION_COLUMNS,
    GAP_FILE,
    RUN_MEANS,
    SIGNAL,
    collect,
    curve_columns,
    curve_file,
    report,
    write_curves,
)
from composer_plugins.pipeline.stage_rollout import ROLLOUT_KEYS, rollout
from composer_plugins.pipeline.stage_train import channel_flags, channels_label, train_cell, train_config

__all__ = [
    "CURVE_PATTERNS",
    "DATA_KEYS",
    "EVAL_KEYS",
    "FRACTION_COLUMNS",
    "GAP_FILE",
    "HEADLINE_ALIASES",
    "PAIRS_KEYS",
    "PATHS",
    "PATHS_REPLAY",
    "ROLLOUT_KEYS",
    "RUN_MEANS",
    "SIGNAL",
    "SOURCES",
    "SPLITS",
    "build_env",
    "channel_flags",
    "channels_label",
    "collect",
    "computation_of",
    "curve_columns",
    "curve_file",
    "data_envs",
    "env_spec_for",
    "eval_envs",
    "evaluate",
    "file_sha256",
    "line_novelty",
    "line_overlap",
    "log_eval_run",
    "novelty_accuracy",
    "pairs",
    "prepare",
    "replay_config",
    "report",
    "rollout",
    "sample_tasks",
    "solution_lines",
    "source_spec",
    "split_overlap",
    "train_cell",
    "train_config",
    "unmlflow_key",
    "write_curves",
    "write_jsonl",
]
