"""Data parallel that divides the work: 2 gloo ranks vs one process on the union of their batches.

The ranks run the real stack (``run_train`` → Lightning ``DDPStrategy`` from ``trainer.strategy: ddp``),
launched from outside as ``torchrun`` would (``tests/training/step/dp_worker.py``).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from composer_plugins.procs import Children

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("dp_worker.py")
if str(WORKER.parent) not in sys.path:  # the env class of the test, importable as the ranks import it
    sys.path.insert(0, str(WORKER.parent))

#: Channels whose normalisers are global: dapo (token count), dr_grpo (B × longest completion),
#: PRIME-RL's dppo (loss-token count), hint distillation (hinted tokens), and a per-sequence mean (grpo).
DP_YAML = """
losses:
  dapo: {weight: 1.0}
  dr_grpo: {weight: 0.5}
  dppo: {weight: 0.5}
  grpo: {weight: 0.25}
  hint_distill: {weight: 0.5}
"""
DP_OVERRIDES = [
    "hints.teacher_margin=true",
    "env={class_path: dp_worker.VariedRewardEnv, init_args: {difficulty: trivial}}",
    "rollout.prompts_per_step=4",
    "rollout.num_generations=4",
    "rollout.max_new_tokens=10",
    "optim.scheduler=constant",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(
    tmp_path: Path, yaml_text: str, overrides: list[str], runs: list[dict], world: int = 2, strategy: str = "ddp"
) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = {
        "world": world,
        "port": _free_port(),
        "yaml": yaml_text,
        "overrides": [
            *overrides,
            f"trainer.devices={world}",
            f"trainer.strategy={strategy}",
            "trainer.dist_timeout_s=120",
        ],
        "runs": runs,
        "out": str(tmp_path),
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    with Children("dp-test") as kids:
        for r in range(world):
            kids.start(
                f"rank{r}", [sys.executable, str(WORKER), str(spec_path), str(r)], log_path=tmp_path / f"rank{r}.log"
            )
        kids.wait(timeout=420, straggler_s=60)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.timeout(600)
def test_two_ranks_divide_the_step_and_match_one_process_on_the_union(make_cfg, tiny_yaml, tmp_path):
    from composer_plugins.training.lightning.module import ComposerModule
    from composer_plugins.training.rollout.rewards import TaskStream, task_drawer
    from composer_plugins.training.step.components import build_env
    from composer_plugins.training.step.policy import load_policy_for, resolve_policy
    from composer_plugins.training.step.record import StepRecord

    cfg, src = make_cfg(DP_YAML, *DP_OVERRIDES)
    resolve_policy(cfg)  # build the tiny model and its SFT start once, before the ranks load them from the cache
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    runs = [
        {"name": "full", "overrides": [f"output_dir={out_b}", "trainer.max_steps=4"], "grads": True},
        {"name": "first", "overrides": [f"output_dir={out_a}", "trainer.max_steps=2"]},
        {"name": "resumed", "overrides": [f"output_dir={out_a}", "trainer.max_steps=4"], "resume": "last"},
    ]
    ranks = _run_ranks(tmp_path, tiny_yaml + DP_YAML, DP_OVERRIDES, runs)
    full = [r["runs"]["full"] for r in ranks]

    # 1. each step's prompts are divided: disjoint shares whose union is the one-process step batch
    env = build_env(cfg, src)
    one = list(TaskStream(task_drawer(env, cfg, "train"), 4, 4, seed=cfg.seed, rank=0, world_size=1))
    for step in range(4):
        shares = [f["tasks"][step] for f in full]
        assert len(shares[0]) == len(shares[1]) == 2
        assert not set(shares[0]) & set(shares[1])
        assert shares[0] + shares[1] == [t["prompt"] for t in one[step]["tasks"]]

    # 2. the loss and the (DDP-averaged) gradient equal one process's on the union of both ranks' rollouts
    tokens = [int(f["rollout"]["completion_mask"].sum()) for f in full]
    widths = [f["rollout"]["completion_mask"].shape[1] for f in full]
    assert tokens[0] != tokens[1] or widths[0] != widths[1]  # else local normalisers would agree by chance
    # the DP gather is the record's row operation: every rank's rows, padded as one process pads them
    union = StepRecord.concat([StepRecord.from_state(f["rollout"]) for f in full], pad_id=0)
    policy, tok = load_policy_for(cfg, env)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
    loss, stats = module.loss_on(union, seed=0)
    loss.backward()
    ddp_stats = full[0]["stats"][0]
    assert full[1]["stats"][0] == ddp_stats  # reduced once, the same on every rank
    assert abs(ddp_stats["loss"] - float(loss.detach())) <= 1e-6
    assert all(any(c is not None for c in f["rollout"]["hint_contexts"]) for f in full)  # both ranks distil hinted rows
    for key in ("dapo/loss", "dr_grpo/loss", "dppo/loss", "grpo/loss", "hint_distill/loss"):
        assert abs(ddp_stats[key] - stats[key]) <= 1e-6, key
    assert ddp_stats["completion_tokens"] == stats["completion_tokens"]
    assert ddp_stats["hint/rows"] == stats["hint/rows"] > 0
    assert abs(stats["loss"]) > 1e-4  # a step with signal
    grads = {n: p.grad for n, p in module.policy.named_parameters() if p.grad is not None}
    assert grads.keys() == full[0]["grads"].keys()
    worst = max(float((grads[n] - full[0]["grads"][n]).abs().max()) for n in grads)
    assert worst <= 1e-6, worst
    for n in grads:
        torch.testing.assert_close(full[0]["grads"][n], full[1]["grads"][n], rtol=0, atol=0)

    # 3. a resumed run continues every rank's stream (and its statistics) exactly
    for r in range(2):
        first, resumed = ranks[r]["runs"]["first"], ranks[r]["runs"]["resumed"]
        assert sorted(first["tasks"]) == [0, 1] and sorted(resumed["tasks"]) == [2, 3]
        for step in (2, 3):
            assert resumed["tasks"][step] == full[r]["tasks"][step]
            assert resumed["stats"][step] == pytest.approx(full[r]["stats"][step], abs=1e-6)


@pytest.mark.timeout(600)
def test_fsdp_on_cpu_trains_like_ddp_and_resumes(make_cfg, tiny_yaml, tmp_path):
    """FSDP (each decoder layer a unit, gloo on CPU): sampling under FSDP, the same steps as DDP, exact resume."""
    from composer_plugins.models.tiny import load_policy
    from composer_plugins.training.step.policy import resolve_policy

    cfg, _ = make_cfg(DP_YAML, *DP_OVERRIDES)
    resolve_policy(cfg)
    text = tiny_yaml + DP_YAML
    ddp_runs = [{"name": "full", "overrides": [f"output_dir={tmp_path / 'd'}", "trainer.max_steps=3"]}]
    ddp = _run_ranks(tmp_path / "ddp", text, DP_OVERRIDES, ddp_runs)
    runs = [
        {"name": "full", "overrides": [f"output_dir={tmp_path / 'f'}", "trainer.max_steps=3"]},
        {"name": "first", "overrides": [f"output_dir={tmp_path / 'g'}", "trainer.max_steps=2"]},
        {"name": "resumed", "overrides": [f"output_dir={tmp_path / 'g'}", "trainer.max_steps=3"], "resume": "last"},
    ]
    fsdp = _run_ranks(tmp_path / "fsdp", text, DP_OVERRIDES, runs, strategy="fsdp")
    for r in range(2):
        f, d = fsdp[r]["runs"]["full"], ddp[r]["runs"]["full"]
        assert f["tasks"] == d["tasks"]
        for step in range(3):  # same rollouts and losses step after step: the updates agree too
            for k in ("loss", "dapo/loss", "dppo/loss", "completion_tokens", "reward"):
                assert f["stats"][step][k] == pytest.approx(d["stats"][step][k], abs=1e-5), (r, step, k)
        resumed = fsdp[r]["runs"]["resumed"]
        assert resumed["tasks"][2] == f["tasks"][2]
        assert resumed["stats"][2] == pytest.approx(f["stats"][2], abs=1e-6)
    # the exported policy is whole (gathered), not a shard
    model, _ = load_policy(tmp_path / "f" / "model")
    ref, _ = load_policy(tmp_path / "d" / "model")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.shape == q.shape and torch.allclose(p, q, atol=1e-5), n


@pytest.mark.timeout(600)
def test_ema_teacher_under_ddp_and_fsdp(make_cfg, tiny_yaml, tmp_path):
    """``teacher: ema``: every DDP rank holds the same EMA, the closed form of the policy's steps; FSDP keeps it
    sharded (gathered here) and equal to DDP's, and a resumed FSDP run ends with the same EMA."""
    from composer_plugins.training.step.policy import resolve_policy

    ema = ["losses.hint_distill.teacher=ema", "losses.hint_distill.ema_rate=0.3"]
    cfg, _ = make_cfg(DP_YAML, *DP_OVERRIDES)
    resolve_policy(cfg)
    text = tiny_yaml + DP_YAML
    ddp_runs = [{"name": "full", "overrides": [f"output_dir={tmp_path / 'd'}", "trainer.max_steps=3"], "weights": True}]
    ddp = _run_ranks(tmp_path / "ddp", text, [*DP_OVERRIDES, *ema], ddp_runs)
    d0, d1 = ddp[0]["runs"]["full"], ddp[1]["runs"]["full"]
    assert d0["ema"].keys() == d1["ema"].keys() and d0["ema"]
    for n in d0["ema"]:  # bit-identical on every rank
        torch.testing.assert_close(d0["ema"][n], d1["ema"][n], rtol=0, atol=0)
    thetas = [d0["policy"][k] for k in range(4)]
    for n, value in d0["ema"].items():
        want = 0.7**3 * thetas[0][n].double() + sum(0.3 * 0.7 ** (3 - k) * thetas[k][n].double() for k in (1, 2, 3))
        torch.testing.assert_close(value, want.float(), rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(d0["ema"][n], thetas[3][n]) for n in d0["ema"])
    for step in range(3):
        assert d0["stats"][step]["hint/rows"] > 0 and "hint/teacher_margin" in d0["stats"][step]

    runs = [
        {"name": "full", "overrides": [f"output_dir={tmp_path / 'f'}", "trainer.max_steps=3"]},
        {"name": "first", "overrides": [f"output_dir={tmp_path / 'g'}", "trainer.max_steps=2"]},
        {"name": "resumed", "overrides": [f"output_dir={tmp_path / 'g'}", "trainer.max_steps=3"], "resume": "last"},
    ]
    fsdp = _run_ranks(tmp_path / "fsdp", text, [*DP_OVERRIDES, *ema], runs, strategy="fsdp")
    for r in range(2):
        full, resumed = fsdp[r]["runs"]["full"], fsdp[r]["runs"]["resumed"]
        for step in range(3):
            for k in ("loss", "hint_distill/loss", "hint/teacher_margin"):
                assert full["stats"][step][k] == pytest.approx(d0["stats"][step][k], abs=1e-5), (r, step, k)
        assert resumed["stats"][2] == pytest.approx(full["stats"][2], abs=1e-6)
        assert full["ema"].keys() == d0["ema"].keys()
        for n in d0["ema"]:
            torch.testing.assert_close(full["ema"][n], d0["ema"][n], rtol=0, atol=1e-5)
            torch.testing.assert_close(resumed["ema"][n], full["ema"][n], rtol=0, atol=0)


def test_rank_share_is_disjoint_and_refuses_uneven_splits():
    from composer_plugins.training.rollout.distributed import rank_share

    items = list(range(8))
    shares = [rank_share(items, r, 4) for r in range(4)]
    assert [x for s in shares for x in s] == items
    with pytest.raises(ValueError, match="multiple of 3"):
        rank_share(items, 0, 3)


def test_task_stream_shares_resume_per_rank():
    from composer_plugins.training.rollout.rewards import TaskStream

    def draw(n: int, seed: int) -> list[dict]:
        return [{"prompt": f"{seed}-{i}"} for i in range(n)]

    whole = [[t["prompt"] for t in b["tasks"]] for b in TaskStream(draw, 6, 4, seed=3, rank=0, world_size=1)]
    for r in range(3):
        s = TaskStream(draw, 6, 4, seed=3, rank=r, world_size=3)
        it = iter(s)
        got = [[t["prompt"] for t in next(it)["tasks"]] for _ in range(2)]
        resumed = TaskStream(draw, 6, 4, seed=3, rank=r, world_size=3)
        resumed.load_state_dict(s.state_dict())
        got += [[t["prompt"] for t in b["tasks"]] for b in resumed]
        assert got == [w[2 * r : 2 * r + 2] for w in whole]


def test_strategy_from_config_and_did_you_mean(make_cfg):
    from lightning.pytorch.strategies import DDPStrategy

    from composer_plugins.core.errors import ConfigError
    from composer_plugins.training.lightning.strategy import build_strategy

    cfg, src = make_cfg("", "trainer.strategy=ddp", "trainer.dist_timeout_s=30")
    s = build_strategy(cfg, None, src)
    assert isinstance(s, DDPStrategy) and s._timeout.total_seconds() == 30
    cfg, src = make_cfg("", "trainer.strategy=ddp_spawn")
    assert build_strategy(cfg, None, src) == "ddp_spawn"
    cfg, src = make_cfg("", "trainer.strategy=lightning.pytorch.strategies.DDPStrategy")
    assert isinstance(build_strategy(cfg, None, src), DDPStrategy)
    cfg, src = make_cfg("", "trainer.strategy=lightning.pytorch.strategies.NoSuchStrategy")
    with pytest.raises(ConfigError, match="trainer.strategy: cannot import"):
        build_strategy(cfg, None, src)
    with pytest.raises(ConfigError, match="Did you mean: 'fsdp'"):
        make_cfg("", "trainer.strategy=fdsp")
    with pytest.raises(ConfigError, match="multiple of 2"):
        make_cfg("", "trainer.devices=2", "rollout.prompts_per_step=3")


def test_cli_train_on_two_devices_reports_once_from_rank_zero(tiny_yaml, tmp_path):
    """``composer-plugins train -S trainer.devices=2``: Lightning starts the second rank by running the same
    command again; both ranks train (each marks its fit end), only rank 0 prints the statistics and ``model:``."""
    import os
    import subprocess

    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_yaml)
    marks = tmp_path / "ranks"
    marks.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
        "COMPOSER_MLFLOW": "0",
        "OMP_NUM_THREADS": "1",
    }
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        "trainer.devices=2",
        "trainer.max_steps=1",
        "trainer.checkpoint_every_n_steps=0",
        "trainer.dist_timeout_s=120",
        "sft.enabled=false",
        "rollout.max_new_tokens=6",
        f"trainer.callbacks=[{{class_path: dp_worker.RankFile, init_args: {{out: '{marks}'}}}}]",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "composer_plugins", "train", "-c", str(cfg), *[a for o in overrides for a in ("-S", o)]],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank0.done", "rank1.done"], r.stderr[-3000:]
    assert {p.read_text() for p in marks.iterdir()} == {"2\n"}
    assert r.stdout.count("model: ") == 1 and r.stdout.count('"train/loss"') == 1, r.stdout
    metrics = json.loads(r.stdout[: r.stdout.index("model: ")])
    assert metrics == json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert r.stdout.rstrip().endswith(f"model: {tmp_path / 'run' / 'model'}")
