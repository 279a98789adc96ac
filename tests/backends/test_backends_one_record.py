"""One record, three trainers: the step record the one experience maker made gives the same composed loss in the
Lightning module, Monarch's trainer step and the TRL adapter; it refuses writes; no adapter fills a placeholder."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from composer_plugins.training.step.record import RecordFrozenError, StepRecord

ROOT = Path(__file__).resolve().parents[2]
CHANNELS = {"grpo": {"weight": 1.0}, "hint_distill": {"weight": 0.5}, "replay_dpo": {"weight": 0.2}}
PAIRS = [
    {"prompt": "Q: 1+1=? A:", "chosen": " 2", "rejected": " 3"},
    {"prompt": "Q: 2+3=? A:", "chosen": " 5", "rejected": " 6"},
]


@pytest.fixture
def config(toy_config):
    # every pair in every step: each trainer samples them in its own order, the DPO mean is the same
    return toy_config(
        CHANNELS,
        PAIRS,
        rollout={"temperature": 0.8},
        replay={"pairs_per_step": len(PAIRS)},
        trainer={"max_steps": 3},
    )


def _module(config):
    from composer_plugins.backends.base import resolve_config
    from composer_plugins.training.lightning.module import ComposerModule

    cfg, src = resolve_config(config)
    torch.manual_seed(0)
    return ComposerModule(cfg, src=src)


def _trl_trainer(config, module):
    """The TRL adapter on the same policy weights, channels and pairs (built as ``TRLBackend.train`` builds it)."""
    from composer_plugins_trl.backend import ComposerGRPOTrainer, TRLBackend, env_reward_func
    from datasets import Dataset

    from composer_plugins.losses.base import ChannelComposer
    from composer_plugins.training.step.components import build_channels, configured_hint_provider
    from composer_plugins.training.step.policy import load_policy_for

    backend = TRLBackend(config)
    c = backend.config
    model, tok = load_policy_for(c, module.env)
    channels = build_channels(c, backend.src)
    policy = next(ch for ch in channels if getattr(ch, "loss_type", None))
    args = backend.grpo_config(policy)
    tasks = module.env.sample_tasks(2, "train", seed=0)
    trainer = ComposerGRPOTrainer(
        model=model,
        reward_funcs=[env_reward_func(module.env, ["answer"])],
        args=args,
        train_dataset=Dataset.from_list(tasks),
        processing_class=tok,
        channels=ChannelComposer(channels),
        hint_provider=configured_hint_provider(c, backend.src),
        hint_env=module.env,
        hint_threshold=c.rollout.success_threshold,
        pairs=PAIRS,
        pairs_per_step=len(PAIRS),
        pair_prompt_length=c.rollout.max_prompt_length,
        pair_max_length=c.replay.max_completion_length,
        chat_template=c.model.chat_template,
    )
    trainer.state.max_steps = c.trainer.max_steps
    return trainer


def _trl_loss(trainer, rec: StepRecord) -> torch.Tensor:
    """TRL's ``compute_loss`` on the micro-batch TRL would hand it: the record's rows (shuffled, as TRL does)."""
    order = torch.tensor([5, 0, 3, 1, 7, 2, 6, 4])
    trainer._records["train"] = rec
    inputs = {
        "prompt_ids": rec.prompt_ids[order],
        "prompt_mask": rec.prompt_mask[order],
        "completion_ids": rec.completion_ids[order],
        "completion_mask": rec.completion_mask[order],
        "advantages": rec.advantages[order],
        "num_items_in_batch": rec.completion_mask.sum().float(),
        "record_rows": order,
    }
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what TRL's training loop sets before each step
    return trainer.compute_loss(trainer.model, inputs)


def test_one_record_gives_the_same_composed_loss_in_lightning_monarch_and_trl(config):
    from composer_plugins_monarch.backend import TrainerActor, _interleave, _rollout_from_wire, _rollout_to_wire

    module = _module(config)
    tasks = module.env.sample_tasks(2, "train", seed=3)
    rec = module.make_rollout_batch(tasks, seed=11)
    assert rec.hint_rows and rec.advantages.abs().sum() > 0  # every channel has signal in this step

    # the record refuses writes once made, naming this line
    with pytest.raises(RecordFrozenError, match=rf"{Path(__file__).name}:\d+: StepRecord.advantages is read-only"):
        rec.advantages = torch.zeros(rec.num_rows)
    with pytest.raises(TypeError):
        rec.extras["x"] = 1  # type: ignore[index]

    lightning, stats = module.loss_on(rec, seed=11)
    assert all(stats[f"{ch}/skipped"] == 0.0 for ch in CHANNELS), stats

    # Monarch: two generator shards of the rollout, merged and interleaved with the record's row operations,
    # sent over the wire; the trainer actor's own step on a module of the same config
    shards = [_rollout_to_wire(rec.select(rows)) | {"rank": r} for r, rows in enumerate([[0, 1, 2, 3], [4, 5, 6, 7]])]
    wire = _interleave(shards, n_prompts=2, pad=0, tasks=list(tasks))
    actor = SimpleNamespace(parts=_module(config).parts)
    monarch, _, remade = TrainerActor._loss(actor, list(tasks), _rollout_from_wire(wire), rec.rewards.tolist(), 11)
    assert torch.equal(remade.completion_ids, rec.completion_ids) and remade.hint_contexts == rec.hint_contexts
    torch.testing.assert_close(remade.advantages, rec.advantages)

    trl = _trl_loss(_trl_trainer(config, module), rec)

    torch.testing.assert_close(monarch, lightning, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trl, lightning, rtol=1e-4, atol=1e-5)
    # a doubled channel weight is seen: the three are not equal by construction
    module.composer.channels[1].weight = 1.0
    doubled, _ = module.loss_on(rec, seed=11)
    assert not torch.allclose(doubled, lightning, rtol=1e-3)


def test_trl_makes_its_record_from_its_own_fields_without_placeholders(config):
    """TRL's generation batch becomes the experience maker's record: TRL's advantages, the recorded rewards
    (a reward model among the reward functions: no rewards at all, never NaN stand-ins), its dataset rows."""
    module = _module(config)
    rec = module.make_rollout_batch(module.env.sample_tasks(2, "train", seed=3), seed=11)
    trainer = _trl_trainer(config, module)
    rows = [dict(rec.task_of(i)) for i in range(rec.num_rows)]
    out = {
        "prompt_ids": rec.prompt_ids,
        "prompt_mask": rec.prompt_mask,
        "completion_ids": rec.completion_ids,
        "completion_mask": rec.completion_mask,
        "advantages": rec.advantages,
    }
    trainer._rewards.outputs = {0: rec.rewards.tolist()}
    made = trainer._make_record(rows, out)
    assert [t["prompt"] for t in made.tasks] == [t["prompt"] for t in rows]
    assert made.advantages is rec.advantages and torch.equal(made.rewards, rec.rewards)
    assert made.old_logprobs is None and made.ref_logprobs is None  # TRL computed none: none claimed
    assert made.hint_rows  # the one add-hint-contexts path, with this batch's groups
    trainer._rewards.unrecorded = ["reward_model"]
    assert trainer._make_record(rows, out).rewards is None


def test_verl_local_record_has_no_advantages_and_its_loss_runs(config, monkeypatch):
    """VeRL computes its own advantages: its record has none (the maker is told so), and its loss path runs."""
    from composer_plugins_verl.backend import VeRLBackend

    from composer_plugins.backends.base import Backend

    seen = {}

    def capture(self, run, loss_of, **kw):
        tasks, ro, rewards, feedback = run.rollout(0)
        record = run.parts.experience.make(tasks, ro, rewards, feedback, old_logprobs=kw.get("old_logprobs", False))
        seen["record"], seen["loss"] = record, loss_of(record, 0)[0]

    monkeypatch.setattr(Backend, "run_local", capture)
    VeRLBackend({**config, "losses": {"dapo": {"weight": 1.0}}}).train()  # VeRL runs the policy channel only
    assert seen["record"].advantages is None and seen["record"].old_logprobs is not None
    assert torch.isfinite(seen["loss"])


def test_no_adapter_fills_a_record_field_itself():
    """Every scored record comes from the experience maker: no adapter constructs a ``StepRecord`` with fields of
    its own (so none can fill a placeholder); the only one an adapter makes is Monarch's rollout record (its
    tasks and rollout, nothing else) for the merge of its generators' shards."""
    for path in sorted(ROOT.glob("packages/*/composer_plugins_*/*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            assert name != "StepRecord", f"{where} constructs a StepRecord field by field"
            if owner == "StepRecord" and name == "from_rollout":
                assert len(node.args) == 2 and not node.keywords, f"{where} adds fields to a rollout record"
