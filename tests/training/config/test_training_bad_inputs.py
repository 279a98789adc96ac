"""Malformed inputs to ``composer-plugins train``, each refused at load (no model is built, no traceback) as
``<file>:<line>: <key>: <problem> — <fix>``, with "did you mean" where a name or key is misspelt."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands

BASE = "output_dir: {d}/run\nsft: {{enabled: false}}\ntrainer: {{max_steps: 1}}\n"

#: name -> (files to write {name: text}, yaml appended to BASE (or replacing it if it starts with '!'),
#:          overrides, where the error is located ('cfg:<line>', '<file>:<line>', 'override'), key, fragments)
CASES: dict[str, tuple[dict[str, str], str, list[str], str, str, list[str]]] = {
    "task file missing": (
        {},
        "data: {{train_path: {d}/nope.jsonl}}\n",
        [],
        "cfg:4",
        "data.train_path",
        ["nope.jsonl does not exist", "— give the path of a JSONL file of tasks"],
    ),
    "task bad JSON on line 3": (
        {"t.jsonl": '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c", answer: 3}\n'},
        "data: {{train_path: {d}/t.jsonl}}\n",
        [],
        "t.jsonl:3",
        "data.train_path",
        ["invalid JSON at column 17", "— fix this line", "cfg:4"],
    ),
    "task line is a list": (
        {"t.jsonl": '{"prompt": "a"}\n[1, 2]\n'},
        "data: {{train_path: {d}/t.jsonl}}\n",
        [],
        "t.jsonl:2",
        "data.train_path",
        ["must be a JSON object, got list", "— fix this line"],
    ),
    "task file empty": (
        {"t.jsonl": ""},
        "data: {{train_path: {d}/t.jsonl}}\n",
        [],
        "t.jsonl",
        "data.train_path",
        ["holds no tasks", "— add one"],
    ),
    "task row without prompt": (
        {"t.jsonl": '{"prompt": "a", "answer": 1}\n{"promt": "b", "answer": 2}\n'},
        "data: {{train_path: {d}/t.jsonl}}\n",
        [],
        "t.jsonl:2",
        "prompt",
        ["missing — every task", "Did you mean: 'prompt'?"],
    ),
    "pairs file missing": (
        {},
        "replay: {{pairs_path: {d}/nope.jsonl}}\nlosses: {{grpo: 1.0, replay_dpo: 0.1}}\n",
        [],
        "cfg:4",
        "replay.pairs_path",
        ["does not exist", "— give the path of a JSONL file"],
    ),
    "pairs bad JSON": (
        {"p.jsonl": '{"prompt": "a", "chosen": "x", "rejected": "y"}\n{"prompt": \n'},
        "replay: {{pairs_path: {d}/p.jsonl}}\nlosses: {{grpo: 1.0, replay_dpo: 0.1}}\n",
        [],
        "p.jsonl:2",
        "replay.pairs_path",
        ["invalid JSON", "— fix this line"],
    ),
    "pair without rejected": (
        {
            "p.jsonl": '{"prompt": "a", "chosen": "x", "rejected": "y"}\n'
            '{"prompt": "b", "chosen": "x", "rejectd": "z"}\n'
        },
        "replay: {{pairs_path: {d}/p.jsonl}}\nlosses: {{grpo: 1.0, replay_dpo: 0.1}}\n",
        [],
        "p.jsonl:2",
        "rejected",
        ["missing — every pair", "Did you mean: 'rejected'?"],
    ),
    "negative lr": ({}, "optim: {{lr: -1.0e-3}}\n", [], "cfg:4", "optim.lr", ["must be > 0, got -0.001", "— use"]),
    "sft batch size 0": (
        {},
        "!output_dir: {d}/run\nsft: {{batch_size: 0}}\n",
        [],
        "cfg:2",
        "sft.batch_size",
        ["must be >= 1, got 0", "— use a positive integer"],
    ),
    "sft steps negative": (
        {},
        "!output_dir: {d}/run\nsft: {{steps: -3}}\n",
        [],
        "cfg:2",
        "sft.steps",
        ["must be >= 0, got -3", "sft.enabled: false"],
    ),
    "tiny hidden size 0": (
        {},
        "model: {{tiny: {{hidden_size: 0}}}}\n",
        [],
        "cfg:4",
        "model.tiny.hidden_size",
        ["must be >= 1, got 0"],
    ),
    "heads do not divide hidden": (
        {},
        "model: {{tiny: {{hidden_size: 30, num_heads: 4}}}}\n",
        [],
        "cfg:4",
        "model.tiny.num_heads",
        ["must divide model.tiny.hidden_size (30)", "— use one of"],
    ),
    "checkpoint every -1": (
        {},
        "!output_dir: {d}/run\ntrainer: {{max_steps: 1, checkpoint_every_n_steps: -1}}\n",
        [],
        "cfg:2",
        "trainer.checkpoint_every_n_steps",
        ["must be >= 0, got -1", "— use 0"],
    ),
    "misspelt env key": (
        {},
        "env: {{name: gsm8k, difficuly: 2}}\n",
        [],
        "cfg:4",
        "env.difficuly",
        ["unknown argument of env 'gsm8k'", "Did you mean: 'difficulty'?"],
    ),
    "bad env value": (
        {},
        "env: {{name: gsm8k, difficulty: impossible}}\n",
        [],
        "cfg:4",
        "env.difficulty",
        ["unknown difficulty 'impossible'", "— fix env.difficulty"],
    ),
    "model path missing": (
        {},
        "model: {{name_or_path: ./no/such/model}}\n",
        [],
        "cfg:4",
        "model.name_or_path",
        ["./no/such/model does not exist", "— give a directory"],
    ),
    "hint provider misspelt": (
        {},
        "hints:\n  provider:\n    name: templat\n",
        [],
        "cfg:6",
        "hints.provider.name",
        ["Unknown hint 'templat'", "Did you mean: 'template'?"],
    ),
    "task row without answer": (
        {"t.jsonl": '{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n'},
        "data: {{train_path: {d}/t.jsonl}}\n",
        [],
        "t.jsonl:2",
        "answer",
        [
            'missing — every task of data.train_path needs "answer" or "solution"',
            "the reward of env 'gsm8k'",
            "this line has ['prompt'] — add it",
        ],
    ),
    "SFT task without solution": (
        {"t.jsonl": '{"prompt": "a", "answer": "1"}\n'},
        "!output_dir: {d}/run\ndata: {{train_path: {d}/t.jsonl}}\n",
        [],
        "t.jsonl:1",
        "target",
        ['needs "target" or "solution" for the SFT warm start', "sft.enabled: false"],
    ),
    "chained hint provider misspelt": (
        {},
        "hints:\n  provider:\n    name: chain\n    providers:\n      - raw_error\n      - templat\n",
        [],
        "cfg:9",
        "hints.provider.providers.1",
        ["Unknown hint 'templat'", "Did you mean: 'template'?"],
    ),
    "hint fallback misspelt": (
        {},
        "hints:\n  provider:\n    name: llm_teacher\n    teacher: oracle\n    fallback: {{name: raw_eror}}\n",
        [],
        "cfg:8",
        "hints.provider.fallback.name",
        ["Unknown hint 'raw_eror'", "Did you mean: 'raw_error'?"],
    ),
    "duplicate YAML key": (
        {},
        "seed: 1\nseed: 2\n",
        [],
        "cfg:5",
        "seed",
        ["duplicate key (first given on line 4", "— keep one of them"],
    ),
    "unknown key as override": (
        {},
        "",
        ["optim.lrr=0.1"],
        "override",
        "optim.lrr",
        ["unknown key", "Did you mean: 'lr'?"],
    ),
}


def test_there_are_twenty_four():
    assert len(CASES) == 24


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_input_gets_a_located_error_with_a_fix(tmp_path: Path, name: str):
    files, extra, overrides, where, key, fragments = CASES[name]
    d = str(tmp_path)
    for fname, text in files.items():
        (tmp_path / fname).write_text(text)
    text = extra[1:].format(d=d) if extra.startswith("!") else BASE.format(d=d) + extra.format(d=d)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    r = CliRunner().invoke(load_commands(), ["train", "-c", str(cfg), *overrides])
    out = r.output
    assert r.exit_code == 2, f"exit {r.exit_code}: {out}\n{r.exception!r}"
    assert "Traceback" not in out and not (tmp_path / "run" / "model").exists(), out
    if where == "override":
        loc = f"command-line override {overrides[0]!r}"
    elif where.startswith("cfg"):
        loc = f"{cfg}:{where.split(':')[1]}"
    else:
        loc = f"{tmp_path}/{where}"
    assert out.startswith(f"Error: {loc}: {key}: "), out
    assert "—" in out or "Did you mean" in out, out  # every message carries a fix (or the name meant)
    for frag in fragments:
        frag = frag.replace("cfg:", f"{cfg}:")
        assert frag in out, f"{frag!r} not in:\n{out}"
    assert not re.search(r"\n\s+File \"", out)


@pytest.mark.parametrize("command", ["train", "sft", "eval"])
def test_an_unknown_hint_provider_is_located_by_every_command(tmp_path: Path, command: str):
    """``sft`` builds the provider deep inside the warm start, where the config's lines are not at hand:
    the name is checked when the config is read, so every command names the file and line."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"output_dir: {tmp_path}/run\nsft: {{steps: 1}}\nhints:\n  provider:\n    name: templat\n")
    r = CliRunner().invoke(load_commands(), [command, "-c", str(cfg)])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"Error: {cfg}:5: hints.provider.name: Unknown hint 'templat'."), r.output
    assert "Did you mean: 'template'?" in r.output and "Available hints: chain, demonstration, llm_teacher" in r.output
    assert not (tmp_path / "run").exists()


def test_an_uncached_hub_id_offline_names_the_key_the_id_and_the_ways_out(tmp_path: Path):
    """``model.name_or_path`` a hub id that is neither cached nor downloadable (``HF_HUB_OFFLINE=1``, empty
    ``HF_HOME``): refused when the run starts, through the real command line, without a traceback."""
    import os
    import subprocess
    import sys

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"output_dir: {tmp_path}/run\nsft: {{enabled: false}}\nmodel:\n  name_or_path: Qwen/Qwen2.5-0.5B\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "COMPOSER_MLFLOW": "0"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run(
        [sys.executable, "-m", "composer_plugins", "train", "-c", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(
        f"Error: {cfg}:4: model.name_or_path: 'Qwen/Qwen2.5-0.5B' is a hub id that is not "
        f"in the Hugging Face cache ({tmp_path / 'hf' / 'hub'})"
    ), r.stderr
    for way in (
        "HF_HUB_OFFLINE is set",
        "— give a local directory",
        "hf download Qwen/Qwen2.5-0.5B",
        "HF_HOME",
        "unset HF_HUB_OFFLINE",
    ):
        assert way in r.stderr, (way, r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_a_policy_the_loader_cannot_fetch_is_a_policy_load_error():
    """Past the start-of-run check (online, hub unreachable), ``load_policy`` turns transformers' ``OSError``
    into :class:`PolicyLoadError`: the id, the hub's reason and the ways out (the CLI locates it at the key)."""
    from composer_plugins.core.errors import ComposerPluginsError
    from composer_plugins.models.tiny import PolicyLoadError, load_policy

    with pytest.raises(PolicyLoadError) as info:  # tests run with HF_HUB_OFFLINE=1 (tests/conftest.py)
        load_policy("composer-plugins-tests/no-such-model")
    e = info.value
    assert isinstance(e, ComposerPluginsError) and e.name_or_path == "composer-plugins-tests/no-such-model"
    assert str(e).startswith("cannot load 'composer-plugins-tests/no-such-model': ") and "\n" not in str(e)
    assert "— give a local directory" in str(e) and "HF_HUB_OFFLINE" in str(e)
