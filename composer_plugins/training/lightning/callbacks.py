"""Lightning callbacks from plugins (registry kind ``callbacks``), chosen by ``trainer.callbacks``.

:func:`composer_plugins.training.lightning.trainer.build_trainer` adds one callback per entry (a registered name,
``{name: ..., <kwargs>}`` or ``{class_path: ..., init_args: ...}``) after its own. See docs/plugins.md
``register_callbacks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_plugins.core.config import Config, build_component
from composer_plugins.core.errors import UnknownPluginError
from composer_plugins.core.plugins import get_registry


def build_callbacks(specs: Sequence[Any], src: Any = None, key: str = "trainer.callbacks") -> list[Any]:
    """The callbacks of ``specs`` (names, ``{name: ...}`` or ``{class_path: ...}``), in order.

    Errors name ``trainer.callbacks[i]`` in ``src``'s file, list the registered callbacks and
    suggest the closest; an object that is not a Lightning callback is refused the same way.
    """
    from lightning.pytorch.callbacks import Callback

    src = src if src is not None else Config()
    if not isinstance(specs, list | tuple):
        raise src.error(key, f"expected a list of callbacks, got {specs!r}.")
    out = []
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        cb = build_component("callbacks", spec, key=where, cfg=src)
        if not isinstance(cb, Callback):
            raise src.error(where, f"built {type(cb).__name__}, which is not a lightning.pytorch.Callback.")
        out.append(cb)
    return out


def check_callback_names(specs: Any, src: Any = None, key: str = "trainer.callbacks") -> None:
    """At config load: every named entry of ``specs`` is registered (a located "did you mean" if not)."""
    src = src if src is not None else Config()
    if not isinstance(specs, list | tuple):
        raise src.error(key, f"expected a list of callbacks, got {specs!r}.")
    names = get_registry().names("callbacks")
    for i, spec in enumerate(specs):
        name = spec if isinstance(spec, str) else spec.get("name") if isinstance(spec, dict) else None
        if isinstance(name, str) and name not in names:
            where = f"{key}[{i}]" if isinstance(spec, str) else f"{key}[{i}].name"
            raise src.error(where, str(UnknownPluginError("callback", name, names)))
