"""The training stack's hooks: optimizers (``optim.name``) and Lightning callbacks (``trainer.callbacks``)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from composer_plugins import hookimpl
from composer_plugins.core import plugins
from composer_plugins.core.errors import ConfigError, UnknownPluginError
from composer_plugins.training.config.sections import OptimSection
from composer_plugins.training.config.train import loads_train_config
from composer_plugins.training.lightning.trainer import build_trainer
from composer_plugins.training.step.optim import build_optimization, build_optimizer

MINIMAL = "losses: {grpo: {weight: 1.0}}\n"


class SignSGD(torch.optim.Optimizer):
    """``p -= lr * sign(grad)``: takes ``lr`` only, so the builder must not pass betas/eps/momentum."""

    def __init__(self, params, lr=0.1, flip=False):
        super().__init__(params, {"lr": lr, "flip": flip})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    s = -1.0 if group["flip"] else 1.0
                    p.add_(torch.sign(p.grad), alpha=-group["lr"] * s)


class CountSteps(L.Callback):
    """Counts optimizer steps seen; ``tag`` comes from the config."""

    def __init__(self, tag="none"):
        self.tag, self.steps = tag, 0

    def on_train_batch_end(self, trainer, *a):
        self.steps += 1


class NotACallback:
    pass


class TrainingPlugin:
    __name__ = "training_test_plugin"

    @hookimpl
    def register_optimizers(self, register):
        register("signsgd", SignSGD, "Sign SGD (test).")

    @hookimpl
    def register_callbacks(self, register):
        register("count_steps", CountSteps, "Count steps (test).")
        register("not_a_callback", NotACallback, "Not a callback (test).")


@pytest.fixture
def with_plugin(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(TrainingPlugin(), name="training_test_plugin")
    plugins.use_plugin_manager(pm)
    yield pm


def test_hook_register_optimizers(with_plugin):
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    opt = build_optimizer(OptimSection(name="signsgd", lr=0.5, betas=[0.1, 0.2], momentum=0.9), [w, frozen])
    assert isinstance(opt, SignSGD) and opt.param_groups[0]["lr"] == 0.5
    assert [p for g in opt.param_groups for p in g["params"]] == [w]  # frozen parameters are left out
    w.grad = torch.tensor([0.3, -4.0, 0.0])
    opt.step()
    assert w.detach().tolist() == [0.5, -1.5, 3.0]
    # optim.args reach the optimizer as they are; the schedule wraps whichever optimizer was built
    cfg, _ = loads_train_config(MINIMAL, ["optim.name=signsgd", "optim.args.flip=true", "optim.warmup_steps=2"])
    conf = build_optimization(cfg.optim, [w], total_steps=10)
    assert conf["optimizer"].param_groups[0]["flip"] is True
    assert conf["optimizer"].param_groups[0]["lr"] == pytest.approx(cfg.optim.lr / 2)  # warm-up step 1 of 2


def test_builtin_optimizers_are_built_as_before():
    w = torch.nn.Parameter(torch.ones(3))
    o = OptimSection(name="adamw", lr=0.01, weight_decay=0.1, betas=[0.8, 0.9], eps=1e-6, momentum=0.5)
    opt = build_optimizer(o, [w])
    assert type(opt) is torch.optim.AdamW
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["betas"], g["eps"]) == (0.01, 0.1, (0.8, 0.9), 1e-6)
    sgd = build_optimizer(OptimSection(name="sgd", lr=0.1, momentum=0.5), [w])
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.5


def test_unknown_optimizer_or_setting_fails_with_the_names(tmp_path):
    p = tmp_path / "train.yaml"
    p.write_text(MINIMAL + "optim:\n  name: adamx\n")
    from composer_plugins.training.config.train import load_train_config

    with pytest.raises(ConfigError, match=rf"{p}:3: optim.name: Unknown optimizer 'adamx'") as ei:
        load_train_config(p)
    assert "Did you mean: 'adam', 'adamw'?" in str(ei.value) and "optimizers: adam, adamw, sgd." in str(ei.value)
    with pytest.raises(UnknownPluginError):
        build_optimizer(OptimSection(name="nope"), [])
    with pytest.raises(ConfigError, match="optimizer 'sgd'.*rejected its settings"):
        build_optimizer(OptimSection(name="sgd", args={"betas_typo": 1}), [torch.nn.Parameter(torch.ones(1))])


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def training_step(self, batch, i):
        return self.w(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_hook_register_callbacks(with_plugin, tmp_path):
    cfg, _ = loads_train_config(
        MINIMAL,
        [
            f"output_dir={tmp_path}",
            "trainer.max_steps=3",
            "trainer.enable_progress_bar=false",
            "trainer.checkpoint_every_n_steps=0",
            "trainer.callbacks=[{name: count_steps, tag: from-config}]",
        ],
    )
    trainer = build_trainer(cfg, logger=False)
    counters = [c for c in trainer.callbacks if isinstance(c, CountSteps)]
    assert len(counters) == 1 and counters[0].tag == "from-config"
    trainer.fit(_Tiny(), torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2))
    assert counters[0].steps == 3


def test_callbacks_errors_name_the_entry(with_plugin, tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.callbacks\[1\]: Unknown callback 'count_step'") as ei:
        loads_train_config(MINIMAL, ["trainer.callbacks=[lr_monitor, count_step]"])
    assert "Did you mean: 'count_steps'" in str(ei.value)
    cfg, _ = loads_train_config(MINIMAL, [f"output_dir={tmp_path}", "trainer.callbacks=[not_a_callback]"])
    with pytest.raises(ConfigError, match=r"trainer.callbacks\[0\]: built NotACallback, which is not"):
        build_trainer(cfg, logger=False)
