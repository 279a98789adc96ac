"""Channel input builders are a pluggy hook: listed with provenance, each passing the conformance check."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from composer_plugins.core import plugins
from composer_plugins.core.hookspecs import hookimpl
from composer_plugins.testing import ConformanceError, check, check_input_builder
from composer_plugins.training.step.assemble import ALWAYS, PAIR_INPUTS


@pytest.mark.parametrize("name", sorted(plugins.get_registry().names("input_builders")))
def test_every_registered_input_builder_keeps_the_contract(name):
    check("input_builders", name)


def materialises_logits(asm: Any) -> dict[str, Any]:
    """A builder that breaks the memory contract: the full ``(rows, tokens, vocab)`` logits."""
    r = asm.record
    vocab = asm.policy.model.config.vocab_size
    return {"full_logits": torch.zeros(*r.completion_ids.shape, vocab)}


def writes_the_record(asm: Any) -> dict[str, Any]:
    asm.record.advantages = asm.record.advantages * 2  # the record is read-only
    return {"doubled": asm.record.advantages}


def counts(asm: Any) -> dict[str, Any]:
    counts.calls += 1  # type: ignore[attr-defined]
    return {"call_count": torch.tensor(float(counts.calls))}  # type: ignore[attr-defined]


counts.calls = 0  # type: ignore[attr-defined]


class BadBuilders:
    __name__ = "bad_builders"

    @hookimpl
    def register_input_builders(self, register: Any) -> None:
        register("full_logits", materialises_logits)
        register("doubled", writes_the_record)
        register("call_count", counts)


@pytest.fixture
def bad(isolated_plugins):
    pm = plugins.make_plugin_manager(entrypoints=False)
    pm.register(BadBuilders(), name="bad_builders")
    plugins.use_plugin_manager(pm)
    yield plugins.get_registry()


def test_the_conformance_check_refuses_what_breaks_the_contract(bad):
    assert bad.get("input_builders", "full_logits").plugin == "bad_builders"
    with pytest.raises(ConformanceError, match=r"input_builders 'full_logits'.*rows × tokens × vocabulary"):
        check_input_builder("full_logits")
    with pytest.raises(ConformanceError, match=r"input_builders 'doubled'.*wrote the step record.*read-only"):
        check("input_builders", "doubled")
    with pytest.raises(ConformanceError, match=r"'call_count' differs between two assemblies"):
        check("input_builders", "call_count")


def test_the_plugin_registers_every_builtin_input_once():
    from composer_plugins.training.step import input_builders
    from composer_plugins.training.step.input_plugin import BUILTINS

    names = [n for provided, _ in BUILTINS.values() for n in provided]
    assert len(names) == len(set(names))
    assert set(ALWAYS) | set(PAIR_INPUTS) <= set(names)
    assert all(callable(getattr(input_builders, attr)) for attr in BUILTINS)


def test_list_shows_the_input_builders_with_their_provider():
    cmd = [sys.executable, "-m", "composer_plugins", "list", "input_builders", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    logprobs = next(r for r in rows if r["name"] == "logprobs")
    assert "composer-plugins" in json.dumps(logprobs) and logprobs["kind"] == "input_builders"
