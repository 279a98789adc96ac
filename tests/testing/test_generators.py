"""Rollout generators: the typed protocol, its conformance check and the multi-turn wrapper's delegation.

The check runs over every registered generator in ``test_conformance.py``; here it is shown catching what it
claims to catch (a generator that breaks the row grouping, one whose seed does not reproduce, an object with no
``generate``), and the ``multi_turn`` wrapper is shown keeping the same protocols as what it wraps.
"""

from __future__ import annotations

from typing import Any

import pytest

from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.testing import ConformanceError, check_generator, plugin_registry


def _hf(*args: Any, **kw: Any) -> Any:
    from composer_plugins.training.rollout.rollouts import HFGenerator

    return HFGenerator().generate(*args, **kw)


class _Shuffled:
    """Rows of prompt 1 first: group_index no longer says rows [i*G, (i+1)*G) are prompt i's."""

    def generate(self, policy: Any, tokenizer: Any, prompts: Any, num_generations: int, **kw: Any) -> Any:
        ro = _hf(policy, tokenizer, prompts, num_generations, **kw)
        ro.group_index = ro.group_index.flip(0)
        return ro


class _Unseeded:
    """Ignores the seed: two calls with one seed sample other tokens."""

    calls = 0

    def generate(self, policy: Any, tokenizer: Any, prompts: Any, num_generations: int, **kw: Any) -> Any:
        type(self).calls += 1
        kw["seed"] = 1000 + type(self).calls
        return _hf(policy, tokenizer, prompts, num_generations, **kw)


class _NoGenerate:
    """Registered as a generator, but has nothing to sample with."""

    def sample(self, *args: Any) -> None:
        return None


class _Broken:
    __name__ = "broken_generators"

    @hookimpl
    def register_rollout_generators(self, register):
        register("shuffled", _Shuffled, description="Rows out of their groups.")
        register("unseeded", _Unseeded, description="Ignores the seed.")
        register("no_generate", _NoGenerate, description="No generate method.")


@pytest.fixture(scope="module")
def broken():
    return plugin_registry(_Broken())[0]


def test_the_builtin_generators_pass_and_declare_their_protocols(broken):
    from composer_plugins.training.rollout.multiturn import MultiTurnGenerator
    from composer_plugins.training.rollout.rollouts import (
        EpisodeGenerator,
        HFGenerator,
        RolloutGenerator,
        ServerGenerator,
        WeightSyncing,
    )

    check_generator("hf", broken)
    check_generator("multi_turn", broken)
    hf = HFGenerator()
    assert isinstance(hf, RolloutGenerator) and not isinstance(hf, WeightSyncing | EpisodeGenerator)
    server = ServerGenerator("http://127.0.0.1:9/v1")
    assert isinstance(server, RolloutGenerator | WeightSyncing) and not isinstance(server, EpisodeGenerator)
    assert isinstance(MultiTurnGenerator("hf"), RolloutGenerator | EpisodeGenerator | WeightSyncing)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("shuffled", r"rows \[i\*G, \(i\+1\)\*G\) must be prompt i's"),
        ("unseeded", "same seed sampled other tokens"),
        ("no_generate", "has no generate"),
    ],
)
def test_the_check_names_the_broken_generator_and_what_broke(broken, name, reason):
    with pytest.raises(
        ConformanceError, match=rf"rollout_generators '{name}' \(plugin 'broken_generators'\): .*{reason}"
    ):
        check_generator(name, broken)


class _Syncing:
    """A weight-syncing generator that records what it is asked (samples with HF generate)."""

    sync_every = 2

    def __init__(self) -> None:
        self.last_synced: int | None = None
        self.synced: list[int] = []

    def generate(self, *args: Any, **kw: Any) -> Any:
        return _hf(*args, **kw)

    def wants_sync(self, step: int) -> bool:
        return self.last_synced is None or step - self.last_synced >= self.sync_every

    def sync(self, policy: Any, tokenizer: Any, step: int, out_dir: Any = None) -> str:
        self.synced.append(step)
        self.last_synced = step
        return f"step-{step}"


def test_multi_turn_syncs_through_what_it_wraps_without_attribute_forwarding():
    from composer_plugins.training.rollout.multiturn import MultiTurnGenerator
    from composer_plugins.training.rollout.rollouts import WeightSyncing

    assert "__getattr__" not in MultiTurnGenerator.__dict__
    inner = _Syncing()
    gen = MultiTurnGenerator(inner, max_turns=2)
    assert isinstance(gen, WeightSyncing) and gen.sync_every == 2
    assert gen.wants_sync(0) and gen.sync(None, None, 0) == "step-0" and inner.synced == [0]
    # the module sets last_synced on every data-parallel rank (only rank 0 syncs): it must reach the engine's
    gen.last_synced = 4
    assert inner.last_synced == 4 and not gen.wants_sync(5) and gen.wants_sync(6)
    # wrapping a generator that holds no weights of its own: never due, sync is a no-op
    plain = MultiTurnGenerator("hf")
    assert plain.sync_every == 0 and not plain.wants_sync(0) and plain.sync(None, None, 0) is None
    plain.last_synced = 3
    assert plain.last_synced is None
