"""The hook specifications of composer-plugins: the whole public plugin API.

Every hook takes a callback. ``register_*`` hooks receive a ``register`` function
that records one component per call; the core attaches provenance (which plugin,
which distribution and version) to what each call registers.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "composer_plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


def fills(kind: str) -> Any:
    """Mark a ``register_*`` hookspec as the one that fills registry kind ``kind``: the registry's kinds
    (:data:`composer_plugins.core.registry.KINDS`) are read from these marks, in this module's order."""

    def mark(spec: Any) -> Any:
        spec.registry_kind = kind
        return spec

    return mark


@hookspec
@fills("losses")
def register_loss_channels(register: Any) -> None:
    """Register loss channels with ``register(name, factory, description=None, **init_params)``."""


@hookspec
@fills("advantage_estimators")
def register_advantage_estimators(register: Any) -> None:
    """Register advantage estimators (``losses.<key>.advantage``) with ``register(name, factory, **init_params)``."""


@hookspec
@fills("teachers")
def register_teachers(register: Any) -> None:
    """Register teacher providers with ``register(name, factory, description=None, **init_params)``."""


@hookspec
@fills("scorers")
def register_teacher_scorers(register: Any) -> None:
    """Register teachers that score a student's tokens (top-k log-probs) with ``register(name, factory, **kw)``."""


@hookspec
@fills("envs")
def register_envs(register: Any) -> None:
    """Register environment adapters with ``register(name, factory, description=None, **init_params)``."""


@hookspec
@fills("hints")
def register_hint_providers(register: Any) -> None:
    """Register hint providers with ``register(name, factory, description=None, **init_params)``."""


@hookspec
@fills("backends")
def register_backends(register: Any) -> None:
    """Register backend runners with ``register(name, factory, description=None, requires=(), install=None)``."""


@hookspec
@fills("rollout_generators")
def register_rollout_generators(register: Any) -> None:
    """Register rollout generators (samplers of completions) with ``register(name, factory, **init_params)``."""


@hookspec
@fills("optimizers")
def register_optimizers(register: Any) -> None:
    """Register optimizers (``optim.name``) with ``register(name, factory, description=None, **init_params)``."""


@hookspec
@fills("callbacks")
def register_callbacks(register: Any) -> None:
    """Register Lightning callbacks (``trainer.callbacks``) with ``register(name, factory, description=None, **kw)``."""


@hookspec
@fills("codecs")
def register_codecs(register: Any) -> None:
    """Register DiLoCo pseudo-gradient codecs (``diloco.compress``) with ``register(name, factory, description)``."""


@hookspec
def register_commands(cli: Any) -> None:
    """Add subcommands to the ``composer-plugins`` click group passed as ``cli``."""


@hookspec
@fills("transports")
def register_transports(register: Any) -> None:
    """Register DiLoCo outer-sync transports (``diloco.transport``) with ``register(name, factory, description)``."""


@hookspec
@fills("input_builders")
def register_input_builders(register: Any) -> None:
    """Register channel input builders (``builder(assembly) -> inputs``) with ``register(input_name, builder)``."""


@hookspec
@fills("executors")
def register_executors(register: Any) -> None:
    """Register DiLoCo replica executors (``--executor``) with ``register(name, factory, description=None, **kw)``."""
