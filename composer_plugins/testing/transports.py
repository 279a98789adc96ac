"""Conformance of DiLoCo outer-sync transports (the ``register_transports`` hook), for their authors' tests.

:func:`check_transport` builds the registered entry as :func:`~composer_plugins.diloco.transports.get_transport`
does and checks its side of the contract (what is checked: docs/plugins.md, ``register_transports``).
Failures raise :class:`~composer_plugins.testing.base.ConformanceError` naming the entry and its provider.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from composer_plugins.core.registry import import_object
from composer_plugins.testing.base import _entry, _fail

__all__ = ["check_transport"]


class _Refused(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _other_value(value: Any) -> Any:
    """A value of the same kind as a setting's default, but not equal to it."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "x" if value is None or isinstance(value, str) else None


def check_transport(name: str, registry: Any = None, **build_kwargs: Any) -> Any:
    """Transport conformance (see the module docstring) of the entry ``name`` of ``registry`` (default: the
    process-wide one); returns the built transport."""
    from composer_plugins.core.errors import ConfigError
    from composer_plugins.diloco.common import DiLoCoConfig
    from composer_plugins.diloco.glue import DiLoCoCallbackBase
    from composer_plugins.diloco.transports import Transport

    entry = _entry("transports", name, registry)
    try:
        t = entry.build(name=entry.name, **build_kwargs)
    except Exception as e:
        raise _fail(entry, f"does not build with name={entry.name!r}: {type(e).__name__}: {e}") from e
    if not isinstance(t, Transport):
        raise _fail(entry, f"built a {type(t).__name__}, not a composer_plugins.diloco.transports.Transport")
    if t.name != entry.name:
        raise _fail(entry, f"built a transport named {t.name!r}, not its registered name {entry.name!r}")
    if t.needs not in ("lighthouse", "store"):
        raise _fail(entry, f"needs {t.needs!r}: a transport needs a 'lighthouse' or a 'store'")
    if not isinstance(t.cloud, bool):
        raise _fail(entry, f"cloud is {t.cloud!r}, not a bool")
    fields = {f.name: f.default for f in dataclasses.fields(DiLoCoConfig)}
    unknown = [k for k in t.ignored if k not in fields]
    if unknown:
        raise _fail(entry, f"ignores {unknown}, which are not diloco.* settings (available: {', '.join(fields)})")

    base = DiLoCoConfig(transport=entry.name)
    try:
        t.validate(base, _Refused)
    except _Refused as e:
        raise _fail(entry, f"refuses the default config: {e}") from e
    for key in t.ignored:
        cfg = dataclasses.replace(base, **{key: _other_value(fields[key])})
        try:
            t.validate(cfg, _Refused)
        except _Refused as e:
            if e.field != key and key not in str(e):
                raise _fail(entry, f"setting the ignored diloco.{key} is refused naming another key: {e}") from e
            continue
        raise _fail(entry, f"accepts diloco.{key} set to {getattr(cfg, key)!r} although it ignores it")
    try:
        base.validate()
    except ConfigError as e:
        raise _fail(entry, f"the default config with diloco.transport={entry.name} does not validate: {e}") from e
    if t.needs == "store":
        try:
            t.require(dataclasses.replace(base, store=None), None)
        except ConfigError as e:
            if getattr(e, "key", None) != "diloco.store":
                raise _fail(entry, f"needs a store, but its error is not located at diloco.store: {e}") from e
        else:
            raise _fail(entry, "needs a store, but starts without one")
    try:
        cls = import_object(t.callback_path)
    except (ImportError, AttributeError, ValueError) as e:
        raise _fail(entry, f"its callback {t.callback_path!r} does not import: {type(e).__name__}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, DiLoCoCallbackBase)):
        raise _fail(entry, f"its callback {t.callback_path!r} is not a DiLoCoCallbackBase subclass")
    return t
