"""Real training steps on the tiny policy: live channels, switches, exact resume, MLflow contents, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from composer_plugins.core.cli import load_commands
from composer_plugins.training.lightning.module import ComposerModule
from composer_plugins.training.rollout.rewards import derive_seed, eval_batches
from composer_plugins.training.runs.run import run_train
from composer_plugins.training.step.components import build_env
from composer_plugins.training.step.policy import load_policy_for, resolve_policy

CHANNELS = """
losses:
  grpo: {{weight: 1.0}}
  hint_distill: {{weight: 0.5}}
  replay_dpo: {{weight: 0.1}}
replay: {{pairs_path: {pairs}, pairs_per_step: 2}}
"""


def _state(path):
    from composer_plugins.models.tiny import load_policy

    model, _ = load_policy(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_all_three_channels_live_finite_and_logged(make_cfg, pairs_file):
    cfg, src = make_cfg(CHANNELS.format(pairs=pairs_file))
    res = run_train(cfg, src)
    assert [r["step"] for r in res.history] == [1, 2]
    for row in res.history:
        for ch in ("grpo", "hint_distill", "replay_dpo"):
            assert row[f"train/{ch}/skipped"] == 0.0, (ch, row)
            assert math.isfinite(row[f"train/{ch}/loss"]), (ch, row)
        assert row["train/hint/rows"] > 0 and math.isfinite(row["train/loss"])
        assert 0.0 <= row["train/reward"] <= 1.0
    # the hint channel is live with a non-zero divergence (the hinted teacher disagrees with the student)
    assert all(row["train/hint_distill/loss"] > 0 for row in res.history)
    # and the policy actually moved away from the SFT start
    start, end = _state(resolve_policy(cfg)), _state(res.model_dir)
    assert any(not torch.equal(start[k], end[k]) for k in start)
    # the CSV history has one row per optimizer step with every channel's loss
    header = (cfg_out := res.output_dir + "/history.csv") and open(cfg_out).readline().strip().split(",")
    want = {"train/grpo/loss", "train/hint_distill/loss", "train/replay_dpo/loss", "train/reward"}
    assert header[0] == "step" and want <= set(header)
    # history.csv steps are integers from 1, the MLflow metric names, and train/reward_mean_over_steps
    # (the run's mean) sits beside train/reward (the last step's) in metrics.json
    assert open(cfg_out).read().splitlines()[1].split(",")[0] == "1"
    assert res.metrics["train/reward"] == res.history[-1]["train/reward"]
    mean = sum(r["train/reward"] for r in res.history) / 2
    assert res.metrics["train/reward_mean_over_steps"] == pytest.approx(mean)


def _count_policy_forwards(module: ComposerModule, tasks, seed: int) -> tuple[int, dict]:
    from composer_plugins.models.logprobs import decoder_body

    calls = []  # generation and scoring both run the decoder body (scoring without the LM head)
    h = decoder_body(module.policy).register_forward_hook(lambda *a: calls.append(1))
    try:
        _, stats = module.compute_step(tasks, seed)
    finally:
        h.remove()
    return len(calls), stats


@pytest.mark.parametrize("off", ["hint_distill", "replay_dpo"])
def test_channel_turned_off_is_not_computed(make_cfg, pairs_file, off):
    cfg_on, src_on = make_cfg(CHANNELS.format(pairs=pairs_file))
    env = build_env(cfg_on)
    policy, tok = load_policy_for(cfg_on, env)
    tasks = env.sample_tasks(2, "train", seed=11)
    on = ComposerModule(cfg_on, policy=policy, tokenizer=tok, env=env, src=src_on)
    on.cache_pair_references()  # once per run (the pairs' reference log-probs), not per step
    n_on, stats_on = _count_policy_forwards(on, tasks, 5)
    assert stats_on[f"{off}/skipped"] == 0.0

    for switch in (f"losses.{off}.enabled=false", f"losses.{off}.weight=0"):
        cfg, src = make_cfg(CHANNELS.format(pairs=pairs_file), switch)
        mod = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
        mod.cache_pair_references()
        n_off, stats = _count_policy_forwards(mod, tasks, 5)
        assert n_off == n_on - 1, (switch, n_on, n_off)  # the teacher / pair forward is gone
        if switch.endswith("false"):
            assert off not in [c.name for c in mod.composer.channels]
            assert not any(k.startswith(f"{off}/") for k in stats)
        else:
            assert stats[f"{off}/skipped"] == 1.0 and f"{off}/loss" not in stats
        if off == "hint_distill":
            assert not mod.needs_teacher and "hint/rows" not in stats
        else:
            assert not mod.needs_pairs
    # with both extra channels off no reference model is even created
    cfg, src = make_cfg(CHANNELS.format(pairs=pairs_file), "losses.hint_distill=false", "losses.replay_dpo=false")
    assert ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src).reference is None


@pytest.mark.parametrize(
    "num_iterations,stop_at,teacher,replay", [(1, 2, "live", False), (2, 3, "live", False), (1, 2, "ema", True)]
)
def test_resume_reproduces_the_uninterrupted_run(
    make_cfg, tmp_path, pairs_file, num_iterations, stop_at, teacher, replay
):
    from lightning.pytorch.callbacks import Callback

    class StopAfter(Callback):
        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step >= stop_at:
                trainer.should_stop = True

    # the fixture's YAML has a trainer section already (a second one is a duplicate key): override it
    over = (
        f"rollout.num_iterations={num_iterations}",
        "trainer.max_steps=4",
        "trainer.checkpoint_every_n_steps=1",
        f"losses.hint_distill.teacher={teacher}",
        "losses.hint_distill.ema_rate=0.2",
    )
    # the replay pairs' reference log-probs: computed at the start, resumed from the checkpoint
    over += (f"replay.pairs_path={pairs_file}", "losses.replay_dpo.weight=0.1") if replay else ()
    cfg_a, src_a = make_cfg("", *over, out=tmp_path / "a")
    full = run_train(cfg_a, src_a)
    cfg_b, src_b = make_cfg("", *over, out=tmp_path / "b")
    first = run_train(cfg_b, src_b, extra_callbacks=[StopAfter()])
    assert [r["step"] for r in first.history] == list(range(1, stop_at + 1))
    resumed = run_train(cfg_b, src_b, resume="last")
    keys = (
        "train/loss",
        "train/grpo/loss",
        "train/grpo/ratio_mean",
        "train/hint_distill/loss",
        "train/reward",
        "train/completion_tokens",
        *(("train/replay_dpo/loss",) if replay else ()),
    )
    got = [[r["step"], *(r[k] for k in keys)] for r in resumed.history]
    want = [[r["step"], *(r[k] for k in keys)] for r in full.history]
    assert got == want  # bit-exact on CPU: same data position, optimizer state and sampling streams
    a, b = _state(full.model_dir), _state(resumed.model_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the EMA teacher is in the checkpoints and resumes bit-identically
    ckpt = [
        torch.load(f"{r.output_dir}/checkpoints/last.ckpt", weights_only=False)["state_dict"] for r in (full, resumed)
    ]
    if replay:  # the six pairs' (chosen, rejected) reference log-probs travel in the checkpoint
        raw = torch.load(f"{resumed.output_dir}/checkpoints/last.ckpt", weights_only=False)
        assert len(raw["composer_pair_refs"]) == 6 and all(len(r) == 2 for r in raw["composer_pair_refs"])
    ema = [{k: v for k, v in c.items() if k.startswith("ema_teacher.")} for c in ckpt]
    assert bool(ema[0]) == (teacher == "ema") and ema[0].keys() == ema[1].keys()
    assert all(torch.equal(ema[0][k], ema[1][k]) for k in ema[0])
    if teacher == "ema":
        assert any(not torch.equal(ema[0][k], ckpt[0][k.removeprefix("ema_teacher.")]) for k in ema[0])
    if num_iterations == 2:
        # every second step re-uses the rollouts: same tokens, and the importance ratio is live
        assert [r["train/iteration"] for r in full.history] == [0.0, 1.0, 0.0, 1.0]
        assert full.history[1]["train/completion_tokens"] == full.history[0]["train/completion_tokens"]
        assert full.history[1]["train/grpo/ratio_mean"] != 1.0 and full.history[0]["train/grpo/ratio_mean"] == 1.0


@pytest.mark.slow
def test_mlflow_run_has_params_metrics_and_checkpoints(make_cfg, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("COMPOSER_MLFLOW", raising=False)
    monkeypatch.setenv("CP_TRAIN_TEST_SECRET", "hunter2-secret")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    extra = f"""
    mlflow: {{enabled: true, tracking_uri: "{uri}", experiment: train-test, run_name: tiny,
             tags: {{api_token: {{$env: CP_TRAIN_TEST_SECRET}}}}}}
    diloco: {{token: {{$env: CP_TRAIN_TEST_SECRET}}}}
    """
    evals = ("eval.num_problems=4", "eval.batch_size=4", "eval.at_start=true", "eval.at_end=true")
    cfg, src = make_cfg(extra, "losses.hint_distill.weight=0.5", *evals)
    res = run_train(cfg, src)
    assert res.run_id
    client = mlflow.MlflowClient(uri)
    run = client.get_run(res.run_id)
    params = run.data.params
    assert params["rollout/num_generations"] == "4" and params["losses/hint_distill/weight"] == "0.5"
    assert params["env/name"] == "gsm8k" and params["trainer/max_steps"] == "2"
    metrics = run.data.metrics
    for k in (
        "train/reward",
        "train/accuracy",
        "train/grpo/loss",
        "train/hint_distill/loss",
        "train/loss",
        "val/accuracy",
        "val/mean_reward",
        "val/pass_at_2",
        "start/accuracy",
    ):
        assert k in metrics, (k, sorted(metrics))
    hist = client.get_metric_history(res.run_id, "train/hint_distill/loss")
    assert len(hist) == 2 and all(m.value > 0 for m in hist)
    # MLflow's steps are history.csv's: 1..max_steps (the start-of-run eval at 0)
    assert sorted(m.step for m in hist) == [r["step"] for r in res.history] == [1, 2]
    assert [m.step for m in client.get_metric_history(res.run_id, "start/accuracy")] == [0]
    arts = {a.path for a in client.list_artifacts(res.run_id)}
    assert {"model", "history.csv"} <= arts and any(a.startswith(("last", "step")) for a in arts)
    ckpts = [a.path for p in arts for a in client.list_artifacts(res.run_id, p) if a.path.endswith(".ckpt")]
    assert ckpts
    blob = json.dumps([params, run.data.tags])
    assert "hunter2-secret" not in blob
    assert (tmp_path / "run" / "mlflow_run.txt").read_text().strip() == res.run_id


def test_cli_sft_train_eval(tiny_yaml, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(tiny_yaml)
    cli = load_commands()
    runner = CliRunner()
    r = runner.invoke(cli, ["sft", "-c", str(cfg), f"output_dir={tmp_path}/sft"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "sft" / "model" / "model.safetensors").exists()
    r = runner.invoke(
        cli,
        [
            "train",
            "-c",
            str(cfg),
            f"output_dir={tmp_path}/rl",
            "trainer.max_steps=1",
            f"model.name_or_path={tmp_path}/sft/model",
            "sft.enabled=false",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[: r.stdout.rindex("}") + 1])  # stderr carries the progress lines
    assert "train/loss" in out and "train/grpo/loss" in out
    assert (tmp_path / "rl" / "model" / "config.json").exists() and (tmp_path / "rl" / "history.csv").exists()
    assert json.loads((tmp_path / "rl" / "metrics.json").read_text())["train/loss"] == out["train/loss"]
    for ckpt in (f"{tmp_path}/rl/model", f"{tmp_path}/rl/checkpoints/last.ckpt"):
        r = runner.invoke(
            cli,
            [
                "eval",
                "-c",
                str(cfg),
                "--checkpoint",
                ckpt,
                "-o",
                f"{tmp_path}/eval.json",
                "eval.predictions=true",
                "sft.enabled=false",
                f"model.name_or_path={tmp_path}/sft/model",
            ],
            catch_exceptions=False,
        )
        assert r.exit_code == 0, r.output
        m = json.loads((tmp_path / "eval.json").read_text())
        assert set(m) == {"gsm8k/accuracy", "gsm8k/mean_reward", "gsm8k/pass_at_2"}
        assert all(0.0 <= v <= 1.0 for v in m.values())
        preds = (tmp_path / "eval.predictions.jsonl").read_text().splitlines()
        assert len(preds) == 8 and {"prompt", "completion", "reward", "correct"} <= set(json.loads(preds[0]))


def test_validation_metrics_are_consistent(make_cfg):
    import lightning as L

    cfg, src = make_cfg()
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
    module.validator.predictions = []
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.validate(module, dataloaders=eval_batches(env, cfg), verbose=False)
    acc = float(trainer.callback_metrics["val/accuracy"])
    preds = module.validator.predictions
    assert acc == pytest.approx(sum(p["correct"] for p in preds) / len(preds))
    sampled = sum(p["samples_correct"] for p in preds) / (2 * len(preds))
    assert float(trainer.callback_metrics["val/mean_reward"]) == pytest.approx(sampled)  # 0/1 reward, 2 samples
    assert 0.0 <= float(trainer.callback_metrics["val/pass_at_2"]) <= 1.0
    # the held-out split never overlaps the training stream
    held = {p["question"] for p in preds}
    train = {t["question"] for i in range(20) for t in env.sample_tasks(4, "train", derive_seed(0, 0, i))}
    assert not held & train


def test_multi_turn_episode_masks_observations(make_cfg):
    cfg, src = make_cfg(
        "", "env.max_turns=2", "rollout.max_turns=2", "rollout.num_generations=4", "rollout.prompts_per_step=2"
    )
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    module = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
    tasks = env.sample_tasks(2, "train", seed=4)
    ro, rewards, _ = module.rollout(tasks, seed=9)
    assert ro.completion_ids.shape[0] == 8 and len(rewards) == 8
    att = ro.extra["attention_mask"]
    # observation tokens are attended to but not trained on; they only appear after a failed first turn
    obs = (att == 1) & (ro.completion_mask == 0)
    two_turn = obs.any(1)
    assert two_turn.any() or all(r == 1.0 for r in rewards)
    for i in two_turn.nonzero().flatten().tolist():
        row_obs = obs[i].nonzero().flatten()
        after = ro.completion_mask[i, row_obs.max() + 1 :]
        assert after.sum() > 0  # a second action follows the observation
        assert "Please try again" in tok.decode(ro.completion_ids[i, row_obs])
    loss, stats = module.compute_step(tasks, seed=9)
    assert torch.isfinite(loss) and stats["hint_distill/skipped"] in (0.0, 1.0)
    loss.backward()


def test_tasks_from_jsonl_files(make_cfg, tmp_path):
    from composer_plugins.envs.gsm8k import GSM8KEnv
    from composer_plugins.training.runs.run import run_eval

    env = GSM8KEnv(difficulty="trivial")
    paths = {}
    for split, n in (("train", 12), ("test", 5)):
        paths[split] = tmp_path / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(t) + "\n" for t in env.sample_tasks(n, split, seed=21)))
    cfg, src = make_cfg(
        "",
        f"data.train_path={paths['train']}",
        f"data.test_path={paths['test']}",
        "trainer.max_steps=1",
        "eval.predictions=true",
    )
    res = run_train(cfg, src)
    assert len(res.history) == 1 and res.history[0]["train/grpo/skipped"] == 0.0
    out = tmp_path / "eval.json"
    metrics = run_eval(cfg, src, checkpoint=res.model_dir, output=str(out))
    assert set(metrics) == {"gsm8k/accuracy", "gsm8k/mean_reward", "gsm8k/pass_at_2"}
    preds = [json.loads(x) for x in out.with_suffix(".predictions.jsonl").read_text().splitlines()]
    want = [json.loads(x)["question"] for x in paths["test"].read_text().splitlines()]
    assert [p["question"] for p in preds] == want


def test_policy_trains_in_train_mode_without_lightning_eval_mode_warning(make_cfg):
    """from_pretrained returns eval mode; the modules put the policy in train mode before Lightning starts."""
    import warnings

    from lightning.pytorch.callbacks import Callback

    from composer_plugins.training.runs.run import run_train
    from composer_plugins.training.runs.sft import sft_train

    modes = []

    class Mode(Callback):
        def on_train_batch_start(self, trainer, pl_module, *a):
            modes.append(pl_module.policy.training)

    cfg, src = make_cfg(
        "", "trainer.max_steps=1", "trainer.checkpoint_every_n_steps=0", "sft.cache=false", "sft.steps=2"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_train(cfg, src, extra_callbacks=[Mode()])
        base = resolve_policy(cfg)
        sft_train(cfg, base, build_env(cfg), cfg.output_dir + "/sft", extra_callbacks=[Mode()])
    assert modes and all(modes), modes
    eval_mode = [str(w.message) for w in caught if "eval mode" in str(w.message)]
    assert not eval_mode, eval_mode


def test_hint_distill_is_clip_ratio_is_one_on_policy_and_live_off_policy(make_cfg):
    """``losses.hint_distill.is_clip``: weight 1 when the rollout is on-policy; the kept rollout-time
    log-probs (``num_iterations > 1``) make it live once the policy has moved. ``topk`` on the same run."""
    cfg, src = make_cfg("", "losses.hint_distill.topk=5", "losses.hint_distill.is_clip=1.5")
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    tasks = env.sample_tasks(2, "train", seed=11)
    mod = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
    assert mod.composer["hint_distill"].topk == 5 and mod.composer["hint_distill"].is_clip == 1.5
    _, stats = mod.compute_step(tasks, 5)
    assert stats["hint/rows"] > 0 and stats["hint_distill/skipped"] == 0.0
    assert stats["hint_distill/is_ratio"] == 1.0 and stats["hint_distill/is_clipped"] == 0.0
    assert math.isfinite(stats["hint_distill/loss"]) and stats["hint_distill/loss"] > 0
    rb = mod.make_rollout_batch(tasks, 5, old_logprobs=True)
    with torch.no_grad():
        for p in mod.policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    _, moved = mod.loss_on(rb, 5)
    assert moved["hint/rows"] > 0
    assert moved["hint_distill/is_ratio"] != pytest.approx(1.0, abs=1e-3)
    assert moved["hint_distill/is_weight"] <= 1.5 and 0.0 <= moved["hint_distill/is_clipped"] <= 1.0


def test_sdpo_proper_without_the_policy_gradient_channel_gets_its_is_weights(make_cfg):
    """``losses.grpo.weight: 0`` (SDPO as published) with ``is_clip``: no other channel asks for the
    policy's log-probs of the sampled tokens, so hint_distill asks for them itself (it raised before)."""
    cfg, src = make_cfg("", "losses.grpo.weight=0", "losses.hint_distill.is_clip=2.0")
    env = build_env(cfg)
    policy, tok = load_policy_for(cfg, env)
    mod = ComposerModule(cfg, policy=policy, tokenizer=tok, env=env, src=src)
    assert [c.name for c in mod.composer.active] == ["hint_distill"]
    assert "logprobs" in mod.composer.required_inputs()
    _, stats = mod.compute_step(env.sample_tasks(2, "train", seed=11), 5)
    assert stats["hint/rows"] > 0 and stats["hint_distill/skipped"] == 0.0
    assert stats["hint_distill/is_ratio"] == 1.0 and math.isfinite(stats["hint_distill/loss"])
