"""TRL backend: ComposerGRPOTrainer's composed ``compute_loss`` equals TRL's own ``GRPOTrainer._compute_loss`` on
the same batch (loss and gradient, six loss types; the comparison sees a doubled loss), and trains with every
channel live."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from composer_plugins_trl.backend import ComposerGRPOTrainer
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from composer_plugins.core.errors import ConfigError
from composer_plugins.models.tiny import load_policy

PROMPTS = [{"prompt": f"Q: {a}+{a}=? A:", "answer": str(2 * a)} for a in range(8)]
PAIRS = [{"prompt": f"Q: {a}+{a}=? A:", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(6)]


def length_reward(completions, **kwargs):
    """A reward with variance inside every group (so advantages, and the policy loss, are non-zero)."""
    return [float(len(c) % 4) / 3 for c in completions]


def answer_hint(feedback, prompt="", completion="", task=None):
    """A plain-callable hint provider (the ``hint(feedback, prompt=, completion=, task=)`` shape)."""
    return f"The answer is {task['answer']}."


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return GRPOConfig(**base)


def _trainer(tiny_model_dir, tmp_path, **kw):
    model, tok = load_policy(tiny_model_dir)
    names = ("channels", "hint_provider", "pairs", "pairs_per_step", "hint_teacher_margin")
    extra = {k: kw.pop(k) for k in list(kw) if k in names}
    return ComposerGRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=_args(tmp_path, **kw),
        train_dataset=Dataset.from_list(PROMPTS),
        processing_class=tok,
        **extra,
    )


LOSS_CASES = [
    ("grpo", {}),
    ("bnpo", {}),
    ("dr_grpo", {}),
    ("dapo", {"epsilon_high": 0.28}),
    ("cispo", {"epsilon_high": 5.0}),
    ("gspo", {"loss_type": "grpo", "importance_sampling_level": "sequence"}),
    # a registry channel spec instead of "policy": TRL's max_completion_length still normalises dr_grpo
    ("dr_grpo_by_name", {"loss_type": "dr_grpo", "channels": [{"name": "dr_grpo", "beta": 0.05}]}),
]


@pytest.mark.parametrize(("name", "extra"), LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_policy_channel_loss_and_gradient_equal_trl(tiny_model_dir, tmp_path, name, extra):
    kw = {"loss_type": name, "beta": 0.05, "gradient_accumulation_steps": 2, **extra}
    tr = _trainer(tiny_model_dir, tmp_path, **kw)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 2
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    # a batch narrower than max_completion_length (dr_grpo must still divide by the configured length)
    width = inputs["completion_ids"].shape[1] - 2
    for k in ("completion_ids", "completion_mask", "ref_per_token_logps"):
        inputs[k] = inputs[k][:, :width]
    # off-policy old log-probs (so clipping is active) and ragged completions
    g = torch.Generator().manual_seed(0)
    mask = inputs["completion_mask"].clone()
    for i, n in enumerate(torch.randint(1, mask.shape[1] + 1, (mask.shape[0],), generator=g).tolist()):
        mask[i, n:] = 0
    inputs["completion_mask"] = mask
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], mask], 1)
    with torch.no_grad():
        lp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, att, mask.shape[1])
    inputs["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    inputs["advantages"] = torch.randn(mask.shape[0], generator=g)
    assert "ref_per_token_logps" in inputs  # beta != 0: TRL computed reference log-probs
    # the record compute_loss reads is made when TRL scores a generation batch: here the crafted batch is the one
    # scored (its row index: every row, in order)
    n = mask.shape[0]
    tr._records["train"] = tr._make_record([{"prompt": ""}] * n, inputs)
    inputs["record_rows"] = torch.arange(n)

    # the two sides are different code: the project's override (defined on its own class, the composed
    # channels) and TRL's GRPOTrainer._compute_loss, called explicitly on the same trainer and batch
    assert "compute_loss" in ComposerGRPOTrainer.__dict__
    assert "_compute_loss" not in ComposerGRPOTrainer.__dict__
    assert ComposerGRPOTrainer.compute_loss is not GRPOTrainer.compute_loss
    params = [p for p in tr.model.parameters() if p.requires_grad]
    ours = ComposerGRPOTrainer.compute_loss(tr, tr.model, inputs)
    g_ours = torch.autograd.grad(ours, params)
    theirs = GRPOTrainer._compute_loss(tr, tr.model, inputs)
    g_theirs = torch.autograd.grad(theirs, params)
    assert float(theirs.detach().abs()) > 1e-4  # a loss that a doubling can be seen in
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    for a, b in zip(g_ours, g_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # the comparison sees a mutation of the composed side: the channel at weight 2 doubles the loss
    (channel,) = tr.composer.active
    channel.weight *= 2.0
    doubled = ComposerGRPOTrainer.compute_loss(tr, tr.model, inputs)
    torch.testing.assert_close(doubled, 2.0 * theirs, rtol=1e-6, atol=1e-7)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(doubled, theirs, rtol=1e-6, atol=1e-7)


def test_training_steps_with_every_channel_live(tiny_model_dir, tmp_path):
    channels = ["policy", {"name": "hint_distill", "weight": 0.5}, {"name": "replay_dpo", "weight": 0.2}]
    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        max_steps=2,
        learning_rate=1e-3,
        loss_type="dapo",
        channels=channels,
        hint_provider=answer_hint,
        pairs=PAIRS,
        pairs_per_step=2,
    )
    before = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    tr.train()
    logs = [r for r in tr.state.log_history if "loss" in r]
    assert len(logs) == 2
    for r in logs:
        assert r["composer/policy/skipped"] == 0.0
        assert r["composer/hint_distill/skipped"] == 0.0 and r["composer/hint/rows"] > 0
        assert r["composer/replay_dpo/skipped"] == 0.0 and r["composer/replay_dpo/pairs"] == 2.0
        assert torch.isfinite(torch.tensor(r["loss"]))
    changed = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no weight moved"
    # the pairs' cached reference log-probs are the starting policy's: log 2 at the first step, not after an update
    assert logs[0]["composer/replay_dpo/loss"] == pytest.approx(0.6931472, abs=1e-5)
    assert abs(logs[-1]["composer/replay_dpo/loss"] - 0.6931472) > 1e-5


def test_ema_teacher_in_the_compute_dtype_and_no_reference_copy_for_cached_pairs(tiny_model_dir, tmp_path):
    """As the native path: under bf16 the EMA teacher's weights are bf16 (its buffers the policy's), and the replay
    pairs' reference log-probs are cached when the trainer is built, so the policy and the teacher are the only
    policy-sized weights the trainer holds; it trains with both."""
    from torch import nn

    from composer_plugins.training.step.input_builders import PAIR_REF_KEYS

    ema = {"name": "hint_distill", "weight": 0.5, "teacher": "ema", "ema_rate": 0.5}
    channels = ["policy", ema, {"name": "replay_dpo", "weight": 0.2}]
    kw = dict(channels=channels, hint_provider=answer_hint, pairs=PAIRS, pairs_per_step=2, loss_type="dapo")
    tr = _trainer(tiny_model_dir, tmp_path, bf16=True, learning_rate=1e-3, **kw)
    assert {p.dtype for p in tr.ema_teacher.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in tr.model.parameters()} == {torch.float32}
    assert [b.dtype for b in tr.ema_teacher.buffers()] == [b.dtype for b in tr.model.buffers()]
    assert tr.ref_model is None and all(set(PAIR_REF_KEYS) <= set(p) for p in tr.pairs)
    largest = max(p.numel() for p in tr.model.parameters())
    held = {
        p.untyped_storage().data_ptr()
        for m in vars(tr).values()
        if isinstance(m, nn.Module)
        for p in m.parameters()
        if p.numel() >= largest
    }
    assert len(held) == 2  # the policy's and the EMA teacher's
    tr.train()
    (log,) = [r for r in tr.state.log_history if "loss" in r]
    assert log["composer/replay_dpo/pairs"] == 2.0 and log["composer/hint/rows"] > 0
    assert torch.isfinite(torch.tensor(log["loss"]))


class GroupRecorder:
    """A provider that reads the rollout group (``group=``) and records what it was given."""

    def __init__(self):
        self.seen = []

    def hint(self, feedback, *, prompt=None, completion=None, task=None, group=None):
        self.seen.append((completion, group))
        return "Correct solution:\n" + str(group.completions[1 - group.index % 2]) if group is not None else None


def test_hint_providers_that_read_groups_get_the_generation_batchs_groups(tiny_model_dir, tmp_path):
    rec = GroupRecorder()
    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        max_steps=1,
        channels=["policy", {"name": "hint_distill", "weight": 0.5}],
        hint_provider=rec,
    )
    tr.train()
    assert rec.seen, "no failed row reached the provider"
    for completion, group in rec.seen:
        assert group is not None and len(group.completions) == 4  # num_generations
        assert group.completion == completion  # the row sits at its own index in its group
        assert list(group.rewards) == pytest.approx(length_reward(list(group.completions)))
        assert group.reward < 1.0 and group.success_threshold == 1.0


@pytest.mark.parametrize("rate", [0.25, 1.0])
def test_ema_teacher_follows_the_policy_after_each_optimizer_step(tiny_model_dir, tmp_path, rate):
    channels = ["policy", {"name": "hint_distill", "weight": 0.5, "teacher": "ema", "ema_rate": rate}]
    tr = _trainer(
        tiny_model_dir,
        tmp_path,
        max_steps=2,
        learning_rate=1e-2,
        loss_type="dapo",
        channels=channels,
        hint_provider=answer_hint,
        hint_teacher_margin=True,
        gradient_accumulation_steps=2,
    )
    ema = tr.ema_teacher.policy
    assert ema is not tr.model and all(not p.requires_grad for p in ema.parameters())
    seen = []

    from transformers import TrainerCallback

    class Record(TrainerCallback):  # registered after the EMA update: sees the policy of each step
        def on_train_begin(self, args, state, control, **kw):
            seen.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})

        def on_step_end(self, args, state, control, **kw):
            seen.append({n: p.detach().clone() for n, p in tr.model.named_parameters()})

    tr.add_callback(Record())
    tr.train()
    logs = [r for r in tr.state.log_history if "loss" in r]
    assert len(seen) == 3 and len(logs) == 2  # two optimizer steps of two micro-batches each
    assert all(r["composer/hint/rows"] > 0 and "composer/hint/teacher_margin" in r for r in logs)
    for n, p in ema.named_parameters():
        want = (1 - rate) ** 2 * seen[0][n] + rate * (1 - rate) * seen[1][n] + rate * seen[2][n]
        torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)
    if rate == 1.0:
        assert all(torch.equal(p, seen[2][n]) for n, p in ema.named_parameters())


def test_hint_channel_without_provider_and_unsupported_options_fail_clearly(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="hint_provider"):
        _trainer(tiny_model_dir, tmp_path, channels=["policy", "hint_distill"])
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        _trainer(tiny_model_dir, tmp_path, top_entropy_quantile=0.5)


def test_a_third_party_input_reaches_its_channel_in_trl(tiny_model_dir, tmp_path):
    """The same third-party channel and input builder as the Lightning test: one edit, both trainers."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training" / "step"))
    try:
        from test_training_assemble import LengthBonus, LengthsPlugin
    finally:
        sys.path.pop(0)
    from composer_plugins.core import plugins

    pm = plugins.get_plugin_manager()  # the backend distributions, and the third party's builders beside them
    pm.register(LengthsPlugin(), name="lengths_plugin")
    plugins.use_plugin_manager(pm)
    try:
        bonus = LengthBonus()
        tr = _trainer(tiny_model_dir, tmp_path, max_steps=1, channels=["policy", bonus])
        tr.train()
    finally:
        pm.unregister(name="lengths_plugin")
        plugins.reset()
    logs = [r for r in tr.state.log_history if "loss" in r]
    assert logs and logs[0]["composer/length_bonus/skipped"] == 0.0
    assert bonus.seen and all(0 < int(v) <= 8 for seen in bonus.seen for v in seen)  # max_completion_length=8


def test_trl_private_surface_change_fails_with_the_fix(monkeypatch):
    from composer_plugins_trl.backend import TRL_PRIVATE_SURFACE, check_trl_surface

    check_trl_surface()  # the installed TRL has what the trainer overrides and calls
    assert set(TRL_PRIVATE_SURFACE) == {"_generate_and_score_completions", "_get_per_token_logps_and_entropies"}

    class Changed(GRPOTrainer):
        def _generate_and_score_completions(self, batch, mode):  # a new signature upstream
            raise AssertionError

    with pytest.raises(RuntimeError, match=r"GRPOTrainer\._generate_and_score_completions is \(self, batch, mode\)"):
        check_trl_surface(Changed)

    class Gone(GRPOTrainer):
        _get_per_token_logps_and_entropies = None

    with pytest.raises(RuntimeError, match="is missing.*docs/backends.md"):
        check_trl_surface(Gone)


class SometimesUnscorable:
    """An env whose every third completion is unscorable (``None``); it keeps the completions it was given."""

    def __init__(self):
        self.seen = []

    def reward(self, prompts, completions, **task):
        self.seen = list(completions)
        return [None if i % 3 == 1 else float(len(c) % 4) / 3 for i, c in enumerate(completions)]


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_unscorable_rows_are_left_out_the_same_way_natively_and_in_trl(tiny_model_dir, tmp_path, scale):
    """The same completions and rewards with ``None`` rows: the native path (``env_rewards`` then
    ``group_advantages``) and TRL's generation batch keep the rows NaN and give the same advantages."""
    from composer_plugins_trl.backend import env_reward_func

    from composer_plugins.losses.functional import group_advantages
    from composer_plugins.training.rollout.rewards import env_rewards

    env = SometimesUnscorable()
    model, tok = load_policy(tiny_model_dir)
    args = _args(tmp_path, per_device_train_batch_size=8, scale_rewards=scale)
    tr = ComposerGRPOTrainer(
        model=model,
        reward_funcs=[env_reward_func(env, ["answer"])],
        args=args,
        train_dataset=Dataset.from_list(PROMPTS),
        processing_class=tok,
    )
    G = tr.num_generations
    batch = next(iter(tr.get_train_dataloader()))
    out = tr._generate_and_score_completions(batch)
    completions = list(env.seen)
    assert len(completions) == len(batch) == 8
    native = torch.tensor(env_rewards(env, batch[::G], completions, G))
    unscorable = torch.tensor([i % 3 == 1 for i in range(len(batch))])
    assert torch.equal(torch.isnan(native), unscorable)
    record = tr._records["train" if tr.model.training else "eval"]  # the batch record: the recorded rewards
    torch.testing.assert_close(native, record.rewards.float().cpu(), equal_nan=True)
    adv = group_advantages(native, G, scale)
    torch.testing.assert_close(adv, out["advantages"].float().cpu(), rtol=1e-5, atol=1e-6)
    assert bool((adv[unscorable] == 0).all())
    # the data tells the two rules apart: unscorable rows counted as 0 move the scorable rows' advantages
    as_zero = group_advantages(torch.nan_to_num(native, nan=0.0), G, scale)
    assert not torch.allclose(as_zero[~unscorable], adv[~unscorable], atol=1e-4)
