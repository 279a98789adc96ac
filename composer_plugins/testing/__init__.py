"""What a plugin author imports in their tests: conformance checks per kind and plugin-manager fixtures.

``test_conformance = conformance_test(my_plugin)`` registers the plugin on a fresh plugin manager beside the
built-ins and generates one test per entry it registers (``kind:name``), each running :func:`check`; the
project's own tests run the same checks over every registered entry. ``fresh_pm`` (built-in plugins only) is
a pytest fixture to import in a ``conftest.py``. See docs/plugins.md ("Testing a plugin in-process").

The test doubles (``loopback_server``, ``teacher_loopback``, ``teacher_data``, ``chat_model``, and
``hf_jobs_hub.FakeJobsHub``, imported on its own) and what this package may import: docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest

from composer_plugins.testing.conformance import (
    ConformanceError,
    check_backend,
    check_builds,
    check_callback,
    check_env,
    check_hint_provider,
    check_loss,
    check_optimizer,
    check_teacher,
    loss_batch,
)
from composer_plugins.testing.executors import check_executor
from composer_plugins.testing.generators import check_generator
from composer_plugins.testing.input_builders import check, check_input_builder
from composer_plugins.testing.transports import check_transport

__all__ = [
    "ConformanceError",
    "check",
    "check_backend",
    "check_builds",
    "check_callback",
    "check_env",
    "check_executor",
    "check_generator",
    "check_hint_provider",
    "check_input_builder",
    "check_loss",
    "check_optimizer",
    "check_teacher",
    "check_transport",
    "conformance_test",
    "fresh_pm",
    "loss_batch",
    "plugin_registry",
]


@pytest.fixture
def fresh_pm() -> Any:
    """A plugin manager with the built-in default plugins only (no entry points)."""
    from composer_plugins.core import plugins

    return plugins.make_plugin_manager(entrypoints=False)


def plugin_registry(plugin: Any, name: str | None = None) -> tuple[Any, str]:
    """``(registry, plugin name)``: the built-ins plus ``plugin`` on a fresh manager (no entry points)."""
    from composer_plugins.core import plugins

    pm = plugins.make_plugin_manager(entrypoints=False)
    pname = name or getattr(plugin, "__name__", None) or type(plugin).__name__
    if pm.get_plugin(pname) is None:
        pm.register(plugin, name=pname)
    pm.check_pending()
    return plugins.build_registry(pm), pname


def conformance_test(
    plugin: Any, *, build_kwargs: Mapping[str, Mapping[str, Any]] | None = None, kinds: Iterable[str] | None = None
) -> Callable[..., None]:
    """A pytest test, parametrized over every entry ``plugin`` registers, that runs :func:`check` on each.

    ``build_kwargs`` maps ``"kind:name"`` to the keyword arguments an entry needs to build (or, for
    ``losses``, ``{"inputs": fn}`` to supply inputs the conformance batch lacks).
    """
    registry, pname = plugin_registry(plugin)
    wanted = set(kinds) if kinds is not None else None
    cases = [
        f"{e.kind}:{e.name}" for e in registry.entries() if e.plugin == pname and (wanted is None or e.kind in wanted)
    ]
    if not cases:
        raise ConformanceError(f"plugin {pname!r} registers no entries{f' of {sorted(wanted)}' if wanted else ''}")
    extra = dict(build_kwargs or {})

    @pytest.mark.parametrize("case", cases)
    def test_conformance(case: str) -> None:
        kind, name = case.split(":", 1)
        check(kind, name, registry, **dict(extra.get(case, {})))

    return test_conformance
