"""The channel × backend table of docs/backends.md, one test per cell.

Every built-in channel in every backend mode: a ``runs``/``limits`` cell trains one tiny step of that channel
in that mode (the composing modes train every channel in one shared step) and checks the channel contributed a
finite loss; a ``refused`` cell checks that building the backend refuses it, located at its ``losses.<key>``
line, naming the mode and a mode that runs it. The table itself is :mod:`composer_plugins.backends.support`;
the doc must equal what it renders.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

from composer_plugins import build
from composer_plugins.backends import support
from composer_plugins.core.errors import ConfigError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: The built-in channels, in table order (``test_the_builtin_channels_are_the_registrys`` keeps it true).
BUILTIN = (
    "bnpo",
    "cispo",
    "dapo",
    "dppo",
    "dr_grpo",
    "grpo",
    "gspo",
    "hint_distill",
    "replay_dpo",
    "replay_simpo",
    "teacher_distill",
)
POLICY_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "gspo", "dppo")
#: Channels whose loss at an on-policy first step is ~0 by construction (ratio 1, group-centred advantages).
ON_POLICY_ZERO = {"grpo", "bnpo", "dr_grpo", "dapo", "gspo", "dppo"}


def _with_backends(fn):
    """``fn()`` with the backend distributions' entry points loaded (at collection, before any fixture runs)."""
    from composer_plugins.core import plugins
    from composer_plugins.core.registry import BACKEND_DISTRIBUTIONS

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(plugins.LOAD_ENV, ",".join(BACKEND_DISTRIBUTIONS.values()))
        plugins.reset()
        try:
            return fn()
        finally:
            plugins.reset()


#: The modes the installed backends declare, and those that compose channels.
MODES, COMPOSING = _with_backends(lambda: (support.MODES, support.COMPOSING))


# ----------------------------------------------------------------------------------------------
# shared fixtures (module scope: each backend mode trains at most a few one-step runs)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env_vars():
    """The toy env importable by class_path in the actor processes too (the conftest loads the backends)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory, env_vars):
    """A teacher model with its own tokenizer, preference pairs on disk, an output root."""
    from composer_plugins.testing.teacher_data import build_tiny_chat_model

    root = tmp_path_factory.mktemp("matrix")
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"Q: {a}+{a}=? A:", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"}) + "\n"
            for a in range(6)
        )
    )
    teacher = build_tiny_chat_model(root / "teacher", vocab_size=260, seed=7)
    return {"root": root, "pairs": pairs, "teacher": str(teacher)}


def _spec(name: str, teacher: str) -> dict[str, Any]:
    if name == "teacher_distill":
        return {"weight": 0.5, "teachers": [{"kind": "causal_lm", "id": "t", "model_path": teacher, "topk": 4}]}
    return {"weight": 0.5 if name in ("hint_distill", "replay_dpo", "replay_simpo") else 1.0}


@pytest.fixture(scope="module")
def make_config(files, tiny_model_dir):
    """``make_config(names, tag)``: the shared one-step config training ``names`` (tiny policy, toy env)."""

    def make(names, tag: str) -> dict[str, Any]:
        return {
            "seed": 0,
            "output_dir": str(files["root"] / tag),
            "cache_dir": str(files["root"] / "cache"),
            "model": {"name_or_path": tiny_model_dir},
            "env": {"class_path": "backend_envs.ToyAddEnv"},
            "sft": {"enabled": False},
            "rollout": {"prompts_per_step": 2, "num_generations": 4, "max_new_tokens": 6},
            "losses": {n: _spec(n, files["teacher"]) for n in names},
            "hints": {"provider": {"class_path": "backend_envs.AnswerHints"}},
            "replay": {"pairs_path": str(files["pairs"]), "pairs_per_step": 2},
            "optim": {"lr": 3e-3},
            "trainer": {"max_steps": 1, "num_threads": 1, "enable_progress_bar": False},
            "eval": {"num_problems": 2, "batch_size": 2, "k": 1, "num_samples": 1, "at_start": False, "at_end": False},
        }

    return make


class Runs:
    """One-step runs, made on first use and kept for the module."""

    def __init__(self, make_config) -> None:
        self.make = make_config
        self.done: dict[tuple[str, ...], dict[str, float]] = {}

    def row(self, mode: str, names: tuple[str, ...]) -> dict[str, float]:
        key = (mode, *names)
        if key not in self.done:
            cfg = self.make(names, "-".join(key).replace(":", "_"))
            backend, _, sub = mode.partition(":")
            opts: dict[str, Any] = {"mode": sub} if sub else {}
            if backend == "monarch":
                opts["generators"] = 1
            if backend == "prime_rl":  # prime_rl itself is not installable here: its local mode is built directly
                from composer_plugins_prime_rl.backend import PrimeRLBackend

                b = PrimeRLBackend(cfg, **opts)
            else:
                b = build("backends", backend, config=cfg, **opts)
            res = b.train()
            assert len(res.history) == 1
            self.done[key] = res.history[0]
        return self.done[key]


@pytest.fixture(scope="module")
def runs(make_config):
    return Runs(make_config)


def _finite(row: dict[str, float], key: str) -> float:
    assert key in row, (key, sorted(row))
    v = float(row[key])
    assert math.isfinite(v), (key, v)
    return v


# ----------------------------------------------------------------------------------------------
# the runs / limits cells, one checker per mode
# ----------------------------------------------------------------------------------------------
def _composed(runs: Runs, mode: str, name: str) -> None:
    """lightning / trl / monarch: every built-in channel in one step; this one live, finite, its metrics there."""
    prefix = {"lightning": "train/", "trl": "composer/", "monarch": ""}[mode]
    row = runs.row(mode, BUILTIN)
    assert row[f"{prefix}{name}/skipped"] == 0.0, row
    loss = _finite(row, f"{prefix}{name}/loss")
    if name in ON_POLICY_ZERO:
        assert _finite(row, f"{prefix}{name}/tokens") > 0  # the channel's own metric: it read the completion tokens
    else:
        assert loss != 0.0
    if name == "hint_distill":
        assert _finite(row, f"{prefix}hint/fraction") > 0  # rows were hinted
    if name == "teacher_distill":
        assert row[f"{prefix}teacher/t/skipped"] == 0.0


def _verl_local(runs: Runs, name: str) -> None:
    """VeRL's own ``compute_advantage`` + ``ppo_loss`` on the registered ``composer_<type>`` loss, one step."""
    row = runs.row("verl:local", (name,))
    _finite(row, "actor/pg_loss")
    assert _finite(row, f"actor/composer_{name}/tokens") > 0


def _verl_ray(runs: Runs, name: str) -> None:
    """The upstream run's loss: the overrides select ``composer_<type>``, which VeRL's own registry resolves, and
    VeRL's ``ppo_loss`` (what its actor workers call) computes a finite loss with a gradient."""
    from composer_plugins_verl import backend as V
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    b = build("backends", "verl", config=runs.make((name,), f"verl_ray-{name}"), mode="ray")
    ov = dict(o.split("=", 1) for o in b.overrides())
    loss_mode = ov["actor_rollout_ref.actor.policy_loss.loss_mode"]
    assert loss_mode == f"composer_{name}"
    fn = get_policy_loss_fn(loss_mode)
    g = torch.Generator().manual_seed(0)
    old = torch.log(torch.rand(4, 5, generator=g) * 0.8 + 0.1)
    new = (old + 0.1 * torch.randn(4, 5, generator=g)).requires_grad_()
    adv = torch.randn(4, 1, generator=g).expand(4, 5)
    mask = torch.ones(4, 5)
    mask[0, 3:] = 0
    cfg = V.make_actor_config(loss_mode, ov["actor_rollout_ref.actor.loss_agg_mode"])
    loss, metrics = fn(old, new, adv, mask, ov["actor_rollout_ref.actor.loss_agg_mode"], cfg)
    assert torch.isfinite(loss) and float(loss.detach()) != 0.0
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert f"actor/composer_{name}/tokens" in metrics


#: PRIME-RL local runs: one policy channel per run, hint_distill and teacher_distill each beside one.
_PRIME_RUNS = {
    "dppo": ("dppo", "hint_distill"),
    "hint_distill": ("dppo", "hint_distill"),
    "dapo": ("dapo", "teacher_distill"),
    "teacher_distill": ("dapo", "teacher_distill"),
    "cispo": ("cispo",),
    "gspo": ("gspo",),
}


def _prime_local(runs: Runs, name: str) -> None:
    """PRIME-RL's per-sample ``loss_fn`` under its aggregation, one optimizer step on the tiny policy."""
    row = runs.row("prime_rl:local", _PRIME_RUNS[name])
    assert _finite(row, "loss") != 0.0
    if name == "hint_distill":
        assert row["hint/skipped"] == 0.0 and _finite(row, "hint/kl") != 0.0
    elif name == "teacher_distill":
        assert row["teacher_distill/skipped"] == 0.0 and _finite(row, "teacher_distill/divergence") > 0.0
    elif name == "dppo":
        _finite(row, "masked_mismatch_kl")
    else:
        assert _finite(row, "tokens") > 0


def _import_object(dotted: str) -> Any:
    """PRIME-RL's ``import_object`` (how ``[trainer.loss] import_path`` is resolved)."""
    import importlib

    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _prime_upstream(runs: Runs, name: str) -> None:
    """The upstream run's loss: the TOML PRIME-RL would read, its ``import_path`` and kwargs, on PRIME-RL's
    per-sample contract and aggregation."""
    from composer_plugins_prime_rl import backend as P

    b = P.PrimeRLBackend(runs.make((name,), f"prime_up-{name}"), mode="prime-rl")
    loss_cfg = tomllib.loads(b.toml())["trainer"]["loss"]
    fn = _import_object(loss_cfg["import_path"])
    g = torch.Generator().manual_seed(1)
    infer = torch.log(torch.rand(3, 6, generator=g) * 0.8 + 0.1)
    trainer = (infer + 0.1 * torch.randn(3, 6, generator=g)).requires_grad_()
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    samples = P.samples_from_batch(trainer, infer, torch.tensor([1.0, -0.5, 0.25]), mask)
    loss, _ = P.aggregate(samples, fn, **loss_cfg["kwargs"])
    assert torch.isfinite(loss) and float(loss.detach()) != 0.0
    (grad,) = torch.autograd.grad(loss, trainer)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def _check_runs(runs: Runs, mode: str, name: str) -> None:
    if mode in COMPOSING:
        _composed(runs, mode, name)
    elif mode == "verl:local":
        _verl_local(runs, name)
    elif mode == "verl:ray":
        _verl_ray(runs, name)
    elif mode == "prime_rl:local":
        _prime_local(runs, name)
    else:
        _prime_upstream(runs, name)


def _check_refused(make_config, tmp_path: Path, mode: str, name: str, cell: support.Cell) -> None:
    """Building the backend on a YAML config refuses the channel at its ``losses.<name>`` line."""
    import yaml

    cfg = make_config(("dppo", name) if name != "dppo" else (name,), "refused")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.strip().startswith(f"{name}:"))
    backend, _, sub = mode.partition(":")
    if backend == "prime_rl":
        from composer_plugins_prime_rl.backend import PrimeRLBackend

        with pytest.raises(ConfigError) as err:
            PrimeRLBackend(str(path), mode=sub)
    else:
        with pytest.raises(ConfigError) as err:
            build("backends", backend, config=str(path), mode=sub)
    e = err.value
    assert e.key == f"losses.{name}" and e.file == str(path) and e.line == line, str(e)
    text = str(e)
    assert f"{backend} backend (mode={sub!r})" in text and cell.note in text
    assert re.search(r"It runs in: (lightning|trl|monarch)", text), text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", BUILTIN)
def test_cell(name, mode, runs, make_config, tmp_path):
    """One cell of the table: it runs (one step, a finite loss from this channel) or is refused at build time."""
    from composer_plugins.core.plugins import get_registry

    c = support.cell(mode, get_registry().build("losses", name))
    if c.runs:
        _check_runs(runs, mode, name)
    else:
        _check_refused(make_config, tmp_path, mode, name, c)


#: For each channel, an option no re-implementing mode carries, with a valid non-default value.
UNCARRIED = {
    **{t: ("beta", 0.04) for t in POLICY_TYPES if t != "dppo"},
    "dppo": ("normalize", "sequences"),
    "hint_distill": ("criterion", "taid"),
    "teacher_distill": ("min_agree", 1),
}


@pytest.mark.parametrize(
    ("mode", "name"),
    _with_backends(
        lambda: [
            (m, n)
            for m in MODES
            if m not in COMPOSING
            for n in BUILTIN
            if support.cell(
                m, "hint" if n == "hint_distill" else "teacher" if n == "teacher_distill" else f"policy:{n}"
            ).runs
        ]
    ),
)
def test_an_option_the_mode_does_not_carry_is_refused_at_its_line(mode, name, make_config, tmp_path):
    """In a mode that re-implements the loss, an option it would drop is refused, located; a carried one is not."""
    import yaml

    opt, value = UNCARRIED[name]
    names = (name,) if name in POLICY_TYPES else ("dppo", name)
    cfg = make_config(names, "options")
    backend, _, sub = mode.partition(":")

    def make(path):
        if backend == "prime_rl":
            from composer_plugins_prime_rl.backend import PrimeRLBackend

            return PrimeRLBackend(str(path), mode=sub)
        return build("backends", backend, config=str(path), mode=sub)

    carried = sorted(support.cell(mode, "policy:dppo" if name == "dppo" else f"policy:{name}").carries or ())
    if name in POLICY_TYPES:  # a carried option passes: its value reaches the upstream loss
        ok = tmp_path / "ok.yaml"
        cfg["losses"][name][carried[0] if name == "dppo" else "epsilon_high"] = 0.3
        ok.write_text(yaml.safe_dump(cfg, sort_keys=False))
        make(ok)
    cfg["losses"][name][opt] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.raises(ConfigError) as err:
        make(bad)
    assert err.value.key == f"losses.{name}.{opt}" and err.value.file == str(bad) and err.value.line, str(err.value)
    assert "does not carry this option" in str(err.value) and "lightning, monarch, trl" in str(err.value)


# ----------------------------------------------------------------------------------------------
# the declaration itself
# ----------------------------------------------------------------------------------------------
def test_the_builtin_channels_are_the_registrys(env_vars):
    assert tuple(support.builtin_channels()) == BUILTIN


def test_the_doc_table_is_the_declaration(env_vars):
    doc = (ROOT / "docs" / "backends.md").read_text()
    start = "<!-- support table: generated by composer_plugins.backends.support.markdown_table() -->\n"
    end = "<!-- end of support table -->"
    assert start in doc and end in doc
    assert doc.split(start, 1)[1].split(end, 1)[0].strip() == support.markdown_table().strip()


def test_the_declaration_matches_the_adapters(env_vars):
    """What the table says VeRL and PRIME-RL run is what their adapters implement."""
    from composer_plugins_prime_rl.backend import POLICIES
    from composer_plugins_verl.backend import POLICY_LOSSES

    for mode in ("verl:local", "verl:ray"):
        assert {t for t in POLICY_TYPES if support.cell(mode, f"policy:{t}").runs} == set(POLICY_LOSSES.values())
    for mode in ("prime_rl:local", "prime_rl:prime-rl"):
        assert {t for t in POLICY_TYPES if support.cell(mode, f"policy:{t}").runs} == set(POLICIES)


def test_a_third_party_channel_gets_an_answer_from_what_it_declares(env_vars):
    """A channel the table has never heard of: composed backends run it, re-implementing ones refuse it."""
    from composer_plugins.losses.base import LossChannel

    class Focal(LossChannel):
        kind = "custom"
        requires = ("logprobs", "advantages", "completion_mask")

    class Hinted(LossChannel):
        kind = "hint"
        needs_teacher = True
        requires = ("hint_mask",)

    assert support.channel_kind(Focal()) == "custom" and support.channel_kind(Hinted()) == "hint"
    assert {m: support.cell(m, Focal()).status for m in support.MODES} == {
        "lightning": "runs",
        "monarch": "runs",
        "prime_rl:local": "refused",
        "prime_rl:prime-rl": "refused",
        "trl": "runs",
        "verl:local": "refused",
        "verl:ray": "refused",
    }
    assert support.cell("prime_rl:local", Hinted()).status == "limits"
    with pytest.raises(ConfigError, match=r"losses\.Focal: .*It runs in: lightning, monarch, trl"):
        support.check_channels("verl:local", [Focal()])
    assert support.check_channels("trl", [Focal(), Hinted()]) == [
        ("Focal", support.Cell("runs")),
        ("Hinted", support.Cell("runs")),
    ]
    with pytest.raises(ConfigError, match="unknown backend mode 'verl:fsdp'"):
        support.cell("verl:fsdp", Focal())


_THIRD_PARTY_BACKEND = """
from composer_plugins import hookimpl
from composer_plugins.backends.base import Backend
from composer_plugins.backends.support import LIMITS, REFUSED, Cell


class PairsOnly(Backend):
    name = "pairs_only"
    support = {
        "pairs_only:fast": {"pairs": Cell(LIMITS, "sigmoid loss only", frozenset({"beta"}))},
        "pairs_only:all": None,
    }


class Plugin:
    __name__ = "pairs_only_plugin"

    @hookimpl
    def register_backends(self, register):
        register("pairs_only", "pairs_only_backend:PairsOnly", "Preference pairs, a third party's backend.")
"""


def test_a_third_party_backend_declares_its_own_cells(tmp_path, monkeypatch):
    """A backend in a package of its own gets its columns in the table and its refusals, the core untouched."""
    import importlib

    from composer_plugins.core import plugins

    (tmp_path / "pairs_only_backend.py").write_text(_THIRD_PARTY_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(importlib.import_module("pairs_only_backend").Plugin(), name="pairs_only_plugin")
    plugins.use_plugin_manager(pm)
    try:
        assert support.MODES == ("lightning", "pairs_only:fast", "pairs_only:all")
        assert support.COMPOSING == ("lightning", "pairs_only:all")
        table = support.markdown_table()
        assert "| channel | lightning | pairs_only (mode=fast) | pairs_only (mode=all) |" in table
        assert "| `replay_dpo` | runs | limits [2] | runs |" in table and "2. sigmoid loss only." in table
        assert "| `grpo` | runs | refused [1] | runs |" in table
        dpo = plugins.get_registry().build("losses", "replay_dpo")
        assert support.check_channels("pairs_only:fast", [dpo]) == [
            ("replay_dpo", support.cell("pairs_only:fast", dpo))
        ]
        grpo = plugins.get_registry().build("losses", "grpo")
        with pytest.raises(
            ConfigError,
            match=r"losses\.grpo: .*pairs_only backend \(mode='fast'\).*It runs in: "
            r"lightning, pairs_only \(mode=all\)",
        ):
            support.check_channels("pairs_only:fast", [grpo])
    finally:
        plugins.reset()


# ----------------------------------------------------------------------------------------------
# the one sampler: rollout.generator is honoured or refused at its line, in every mode
# ----------------------------------------------------------------------------------------------
#: The modes that sample through the one Sampler (the Lightning module, the backends' local modes).
SAMPLED_HERE = {"lightning", "verl:local", "prime_rl:local"}


@pytest.fixture(scope="module")
def rollout_server(tiny_model_dir):
    from composer_plugins.testing.loopback_server import RolloutServerProcess

    with RolloutServerProcess(model=tiny_model_dir) as srv:
        yield srv


def _build_mode(mode: str, path: Path) -> Any:
    """The backend of ``mode`` (``backend[:sub-mode]``) built from the config file ``path``."""
    backend, _, sub = mode.partition(":")
    opts: dict[str, Any] = {"mode": sub} if sub else {}
    if backend == "monarch":
        opts["generators"] = 1
    if backend == "prime_rl":
        from composer_plugins_prime_rl.backend import PrimeRLBackend

        return PrimeRLBackend(str(path), **opts)
    return build("backends", backend, config=str(path), **opts)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_a_server_generator_is_honoured_or_refused_at_its_line(mode, make_config, rollout_server, tmp_path):
    """``rollout.generator: server`` samples from the server (its weights pushed first) where the one sampler
    runs, and is refused at its YAML line, naming the mode, where the mode samples on its own."""
    import yaml

    cfg = make_config(("dppo",), f"server-{mode.replace(':', '_')}")
    cfg["rollout"]["generator"] = {"name": "server", "base_url": rollout_server.base_url}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    backend = mode.partition(":")[0]
    if mode not in SAMPLED_HERE:
        line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.strip().startswith("generator:"))
        with pytest.raises(ConfigError) as err:
            _build_mode(mode, path)
        assert (err.value.key, err.value.file, err.value.line) == ("rollout.generator", str(path), line)
        assert f"the {backend} backend" in str(err.value) and "samples on its own" in str(err.value)
        return
    before = rollout_server.stats()
    res = _build_mode(mode, path).train()
    after = rollout_server.stats()
    assert len(res.history) == 1 and after["reloads"] == before["reloads"] + 1  # the policy's weights went first
    assert after["requests"] > before["requests"]  # and the rollouts came from the server


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [m for m in MODES if m not in SAMPLED_HERE])
def test_an_off_policy_share_is_refused_at_its_line_where_the_mode_samples_on_its_own(mode, make_config, tmp_path):
    """``rollout.on_policy_fraction < 1`` reads the dataset's completions on some steps, which only the one sampler
    does (tests/training/step/test_training_on_policy_fraction.py): a mode sampling on its own refuses it at its
    line."""
    import yaml

    cfg = make_config(("dppo",), f"lmbda-{mode.replace(':', '_')}")
    cfg["rollout"]["on_policy_fraction"] = 0.5
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    backend = mode.partition(":")[0]
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "on_policy_fraction" in t)
    with pytest.raises(ConfigError) as err:
        _build_mode(mode, path)
    assert (err.value.key, err.value.file, err.value.line) == ("rollout.on_policy_fraction", str(path), line)
    assert f"the {backend} backend" in str(err.value) and "samples every step on its own" in str(err.value)


#: A non-default value of each setting only the native path honours in full (``OWN_PATH_SETTINGS``), and the ones a
#: mode sampling on its own honours all the same: Monarch's generators sample through the one Sampler, its trainer
#: steps the one optimizer builder.
OWN_PATH_VALUES = {"rollout.compile": "on", "compute.kernels": "chunked", "optim.fused": False}
HONOURED = {"monarch": ("rollout.compile", "optim.fused")}


@pytest.mark.parametrize("key", list(OWN_PATH_VALUES))
@pytest.mark.parametrize("mode", [m for m in MODES if m not in SAMPLED_HERE])
def test_a_setting_a_mode_sampling_on_its_own_ignores_is_refused_at_its_line(mode, key, make_config, tmp_path):
    """``rollout.compile``, ``compute.kernels`` and ``optim.fused`` set to other than their default are honoured or
    refused at their YAML line, naming the mode and the key, by every mode that samples or optimises on its own."""
    import yaml

    from composer_plugins.training.step.experience import OWN_PATH_SETTINGS, Sampler

    assert set(OWN_PATH_VALUES) == set(OWN_PATH_SETTINGS)
    cfg = make_config(("dppo",), f"own-{mode.replace(':', '_')}")
    section, name = key.split(".")
    cfg.setdefault(section, {})[name] = OWN_PATH_VALUES[key]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    if key in HONOURED.get(mode, ()):
        backend = _build_mode(mode, path)
        if key == "rollout.compile":  # the sampler the generator actors build from the config compiles
            assert Sampler.from_config(backend.config).generator.compile == "on"
        return
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.strip().startswith(f"{name}:"))
    with pytest.raises(ConfigError) as err:
        _build_mode(mode, path)
    assert (err.value.key, err.value.file, err.value.line) == (key, str(path), line)
    assert f"the {mode.partition(':')[0]} backend" in str(err.value) and "does not honour" in str(err.value)


_THIRD_PARTY_GENERATOR = """
from composer_plugins import hookimpl
from composer_plugins.training.rollout.rollouts import HFGenerator

CALLS = []


class Greedy(HFGenerator):
    def generate(self, policy, tokenizer, prompts, num_generations, **sampling):
        CALLS.append(sampling["seed"])
        return super().generate(policy, tokenizer, prompts, num_generations, **{**sampling, "do_sample": False})


class Plugin:
    __name__ = "greedy_plugin"

    @hookimpl
    def register_rollout_generators(self, register):
        register("greedy", "greedy_generator:Greedy", "Greedy decoding, a third party's generator.")
"""


@pytest.mark.timeout(600)
def test_a_third_party_generator_samples_a_backends_local_mode(make_config, tmp_path, monkeypatch):
    """A generator in a package of its own, named in ``rollout.generator``, samples VeRL's local mode: the one
    sampler is built from config there too, the core untouched."""
    import importlib

    from composer_plugins.core import plugins

    (tmp_path / "greedy_generator.py").write_text(_THIRD_PARTY_GENERATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("greedy_generator")
    pm = plugins.make_plugin_manager()
    pm.register(mod.Plugin(), name="greedy_plugin")
    plugins.use_plugin_manager(pm)
    try:
        cfg = make_config(("grpo",), "greedy")
        cfg["rollout"]["generator"] = "greedy"
        res = build("backends", "verl", config=cfg, mode="local").train()
    finally:
        plugins.reset()
    assert len(res.history) == 1 and len(mod.CALLS) == 1


# ----------------------------------------------------------------------------------------------
# a channel's configured advantage estimator (the table's `losses.<key>.advantage` row)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", _with_backends(lambda: [m for m in MODES if not support.cell(m, "advantage").runs]))
def test_an_advantage_estimator_is_refused_at_its_line_where_the_mode_cannot_honour_it(mode, make_config, tmp_path):
    import yaml

    cfg = make_config(("dppo",), f"adv-{mode.replace(':', '_')}")
    cfg["losses"]["dppo"]["advantage"] = {"name": "rloo"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.strip().startswith("advantage:"))
    with pytest.raises(ConfigError) as err:
        _build_mode(mode, path)
    assert (err.value.key, err.value.file, err.value.line) == ("losses.dppo.advantage", str(path), line)
    assert "cannot honour" in str(err.value) and "run it in: lightning, monarch, trl" in str(err.value)


_THIRD_PARTY_ESTIMATOR = """
import torch
from composer_plugins import hookimpl


class Constant:
    def __init__(self, value=0.0):
        self.value = value

    def __call__(self, rewards, group_size):
        return torch.full_like(rewards, self.value)


@hookimpl
def register_advantage_estimators(register):
    register("constant", Constant, "The same advantage for every row.")
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", COMPOSING)
def test_a_composing_mode_honours_a_third_party_advantage_estimator(mode, make_config, tmp_path, monkeypatch):
    """The table's `runs` for the composing modes: the channel reads its configured composition of the built-in
    `group` and a third party's `constant` estimator (its distribution's entry point, loaded in every actor too): at
    the first, on-policy step (ratio 1) the grpo loss is -mean(A) = -(0.5·0 + 0.5·0.6)."""
    from composer_plugins.core import plugins

    info = tmp_path / "site" / "cp_advconst-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cp-advconst\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[composer_plugins]\nadvconst = cp_advconst\n")
    (tmp_path / "site" / "cp_advconst.py").write_text(_THIRD_PARTY_ESTIMATOR)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(plugins.LOAD_ENV, os.environ[plugins.LOAD_ENV] + ",cp-advconst")
    plugins.reset()
    cfg = make_config(("grpo",), f"adv-{mode}")
    parts = [{"name": "group", "weight": 0.5}, {"name": "constant", "weight": 0.5, "value": 0.6}]
    cfg["losses"]["grpo"]["advantage"] = {"compose": parts}
    res = _build_mode(mode, _write(tmp_path / "run.yaml", cfg)).train()
    prefix = {"lightning": "train/", "trl": "composer/", "monarch": ""}[mode]
    assert res.history[0][f"{prefix}grpo/loss"] == pytest.approx(-0.3, abs=1e-3)


def _write(path: Path, cfg: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_channel_is_read_by_the_kind_it_declares_and_an_undeclared_one_warns(env_vars):
    """The row is the declared ``kind`` (whatever the inputs suggest); a channel from before 0.2.3 that declares
    none is read from its inputs with a deprecation warning naming the line to add; a bad kind is refused."""
    import pytest

    from composer_plugins.core.errors import PluginDeprecationWarning
    from composer_plugins.losses.base import LossChannel, check_contract

    class ReadsAdvantagesButIsHint(LossChannel):
        kind = "hint"
        requires = ("advantages", "completion_mask")

    class OldHinted(LossChannel):
        needs_teacher = True
        requires = ("hint_mask",)

    class OldGRPO(LossChannel):
        loss_type = "grpo"
        requires = ("logprobs", "advantages", "completion_mask")

    assert support.channel_kind(ReadsAdvantagesButIsHint()) == "hint"
    with pytest.warns(PluginDeprecationWarning, match=r"declare `kind = 'hint'`"):
        assert support.channel_kind(OldHinted()) == "hint"
    with pytest.warns(PluginDeprecationWarning, match=r"declare `kind = 'policy'`"):
        assert support.channel_kind(OldGRPO()) == "policy:grpo"
    from composer_plugins.losses.policy import DPPOChannel, PolicyLossChannel

    assert support.channel_kind(DPPOChannel()) == "policy:dppo"
    assert support.channel_kind(PolicyLossChannel(loss_type="cispo")) == "policy:cispo"

    class Typo(LossChannel):
        kind = "polcy"

    with pytest.raises(TypeError, match="declares kind = 'polcy'; valid: policy, hint"):
        check_contract(Typo)
