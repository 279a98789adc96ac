"""One path from config to a step: the Lightning module, the TRL backend, the VeRL / PRIME-RL local modes and
Monarch's trainer actor all get their step's pieces from ``StepComponents.from_config``; Monarch builds no
``ComposerModule``; the components count the optimizer steps they take and update the EMA teacher."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from composer_plugins.backends.base import Backend, resolve_config
from composer_plugins.training.step.components import StepComponents
from composer_plugins.training.step.optim import schedule

CHANNELS = {"grpo": {"weight": 1.0}, "hint_distill": {"weight": 0.5, "teacher": "ema", "ema_rate": 0.5}}


@pytest.fixture
def config(toy_config):
    return toy_config(CHANNELS, [{"prompt": "Q: 1+1=? A:", "chosen": " 2", "rejected": " 3"}], optim={"lr": 3e-2})


@pytest.fixture
def built(monkeypatch):
    """Every ``StepComponents`` that ``from_config`` built, in order."""
    real = StepComponents.from_config.__func__
    out: list[StepComponents] = []

    def spy(cls, *args, **kwargs):
        out.append(real(cls, *args, **kwargs))
        return out[-1]

    monkeypatch.setattr(StepComponents, "from_config", classmethod(spy))
    return out


def test_the_lightning_module_holds_the_components_from_config(config, built):
    from composer_plugins.training.lightning.module import ComposerModule

    cfg, src = resolve_config(config)
    module = ComposerModule(cfg, src=src)
    (parts,) = built
    assert module.parts is parts and module.policy is parts.policy and module.ema_teacher is parts.ema_teacher
    assert module.experience is parts.experience and module.stepper is parts.stepper
    assert module.sampler is parts.sampler and module.hint_provider is parts.hint_provider
    assert parts.ema_teacher is not None and parts.hint_provider is not None


@pytest.mark.parametrize("name", ["verl", "prime_rl"])
def test_the_local_modes_build_their_run_from_config(config, built, monkeypatch, name):
    seen = {}
    monkeypatch.setattr(Backend, "run_local", lambda self, run, loss_of, **kw: seen.setdefault("run", run))
    if name == "verl":
        from composer_plugins_verl.backend import VeRLBackend

        VeRLBackend({**config, "losses": {"dapo": {"weight": 1.0}}}).train()
    else:
        from composer_plugins_prime_rl.backend import PrimeRLBackend

        hinted = {"dppo": {"weight": 1.0}, "hint_distill": CHANNELS["hint_distill"]}
        PrimeRLBackend({**config, "losses": hinted}).train()
    (parts,) = built
    assert seen["run"].parts is parts and seen["run"].sampler is parts.sampler
    # VeRL's loss is its own: no channel pieces; PRIME-RL's hint stream gets the config's provider and EMA teacher
    assert (parts.hint_provider is None and parts.ema_teacher is None) == (name == "verl")
    assert (parts.experience.advantage_kwargs is None) == (name == "verl")  # VeRL computes its own advantages


def test_the_trl_backend_gets_its_channels_provider_and_pairs_from_config(config, built, monkeypatch):
    import composer_plugins_trl.backend as trl_backend

    class Built(Exception):
        pass

    def trainer(**kw):
        raise Built(kw)

    monkeypatch.setattr(trl_backend, "ComposerGRPOTrainer", trainer)
    cfg = {**config, "losses": {**CHANNELS, "replay_dpo": {"weight": 0.2}}}
    with pytest.raises(Built) as info:
        trl_backend.TRLBackend(cfg).train()
    (parts,) = built
    kw = info.value.args[0]
    assert kw["channels"] is parts.composer and kw["hint_provider"] is parts.hint_provider is not None
    assert kw["pairs"] == parts.pairs and len(parts.pairs) == 1
    # TRL binds the model-bound pieces to its own wrapped model: none are made here
    assert parts.ema_teacher is None and parts.reference is None and parts.teacher_scoring is None


def test_monarch_trainer_actor_steps_its_components_without_a_module(config, built, monkeypatch, tiny_model_dir):
    from composer_plugins_monarch.backend import TrainerActor

    from composer_plugins.core.config import to_dict
    from composer_plugins.training.lightning.module import ComposerModule

    def refuse(*a, **kw):
        raise AssertionError("Monarch's trainer actor built a ComposerModule")

    monkeypatch.setattr(ComposerModule, "__init__", refuse)
    cfg, _ = resolve_config(config)
    actor = SimpleNamespace()
    TrainerActor.__init__(actor, to_dict(cfg), tiny_model_dir)
    (parts,) = built
    assert actor.parts is parts and parts.steps == 0
    tasks = parts.env.sample_tasks(2, "train", seed=3)
    ro, rewards, _ = parts.sampler.sample(parts.policy, parts.tokenizer, parts.env, tasks, seed=11)
    ema = [p.detach().clone() for p in parts.ema_teacher.parameters()]
    for step in range(2):
        loss, _, record = TrainerActor._loss(actor, tasks, ro, rewards, seed=11)
        assert parts.last_meta.step == step and record.num_rows == 8 and torch.isfinite(loss)
        parts.optimize(loss)
        assert parts.steps == step + 1  # counted by the object that steps
    moved = [not torch.equal(a, b) for a, b in zip(ema, parts.ema_teacher.parameters(), strict=True)]
    assert any(moved)  # the EMA teacher followed the policy (ema_rate 0.5) inside optimize
    # the learning rate follows optim's warm-up and schedule as under Lightning (it was constant here)
    want = schedule(cfg.optim.scheduler, cfg.optim.warmup_steps, cfg.trainer.max_steps)(2) * cfg.optim.lr
    assert parts.optimizer.param_groups[0]["lr"] == pytest.approx(want) and want != cfg.optim.lr
