"""DiLoCo's outer-sync transports, as registered objects: the one place a transport name is compared
(docs/plugins.md, "register_transports"). Import-light (no torch): the launcher and the CLI read it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

from composer_plugins.core.errors import ComposerPluginsError, closest
from composer_plugins.core.registry import import_object
from composer_plugins.diloco import env as _env

#: a :class:`~composer_plugins.diloco.common.DiLoCoConfig` (not imported: common imports this module)
DiLoCoConfig = Any
ReplicaInfo = Any
__all__ = ["ObjectStoreTransport", "Transport", "get_transport"]

#: (registry id, name) -> the built transport
_cache: dict[tuple[int, str], Transport] = {}

Bad = Callable[[str, str], Exception]


@dataclasses.dataclass(frozen=True)
class Transport:
    """One outer-sync transport (see the module docstring). Built by its registered factory, which
    :func:`get_transport` calls with ``name=`` the name it was registered under."""

    #: what the launcher must provide: a torchft lighthouse (it starts one) or a store URL
    needs: Literal["lighthouse", "store"]
    #: ``module:Class`` of the callback (imported when built)
    callback_path: str
    #: can ``--executor hf_jobs|modal`` run its replicas (they cannot reach a lighthouse)?
    cloud: bool
    #: ``diloco.*`` keys this transport does not use: refused when set to anything but their default
    ignored: tuple[str, ...] = ()
    #: the name ``diloco.transport`` selects it by (its registered name)
    name: str = ""

    def validate(self, config: DiLoCoConfig, bad: Bad) -> None:
        """Raise ``bad(field, message)`` for a config this transport cannot run."""
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        for key in self.ignored:
            if getattr(config, key) != defaults[key]:
                raise bad(
                    key,
                    f"diloco.transport={self.name} does not use {key} (set to {getattr(config, key)!r}). "
                    f"HINT: remove it, or use a transport that does.",
                )

    def store_url(self, config: DiLoCoConfig) -> str | None:
        return None

    def require(self, config: DiLoCoConfig, store: str | None = None) -> None:
        """What the launcher must provide is there: a store URL for ``needs == "store"`` (``ConfigError``)."""
        if self.needs == "store" and not (store or self.store_url(config)):
            from composer_plugins.core.errors import ConfigError

            raise ConfigError(
                f"diloco.transport={self.name} needs a store. HINT: -S diloco.store=s3://bucket/run "
                "(or gs://..., az://..., file:///abs/path).",
                key="diloco.store",
            )

    def callback(self, config: DiLoCoConfig, replica: ReplicaInfo | None = None) -> Any:
        """This transport's Lightning callback for one replica."""
        return import_object(self.callback_path)(config, replica)


class ObjectStoreTransport(Transport):
    def validate(self, config: DiLoCoConfig, bad: Bad) -> None:
        super().validate(config, bad)
        if config.num_fragments != 1 or config.fragment_sync_delay:
            raise bad(
                "num_fragments",
                "the object_store transport syncs the whole model at once: set num_fragments=1 "
                "and fragment_sync_delay=0 (streaming fragments need transport=torchft).",
            )
        store = self.store_url(config)
        if store:
            from composer_plugins.diloco.urls import check_store_url

            check_store_url(store, lambda msg: bad("store", msg))
        for name in ("round_timeout_s", "store_retry_s", "poll_s", "poll_max_s", "request_timeout_s"):
            if getattr(config, name) <= 0:
                raise bad(name, f"must be > 0, got {getattr(config, name)}.")

    def store_url(self, config: DiLoCoConfig) -> str | None:
        return config.store or os.environ.get(_env.ENV_STORE) or None


def registered(kind: str, name: str, error: Callable[[str], Exception], tail: str = "") -> Any:
    """The registry entry of ``kind`` named ``name``; an unknown name raises ``error(message)`` listing the
    available ones (and the closest, then ``tail``)."""
    from composer_plugins.core.plugins import get_registry

    names = get_registry().names(kind)
    if str(name).lower() not in names:
        near = closest(str(name), names)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise error(f"unknown {kind.removesuffix('s')} {name!r}; available: {', '.join(names)}.{hint}{tail}")
    return get_registry().get(kind, name)


def get_transport(name: str, error: Callable[[str], Exception] | None = None) -> Transport:
    """The transport registered as ``name`` (``register_transports``), built once per registry; unknown names list
    the available ones (and the closest), raised as ``error(message)``."""
    from composer_plugins.core.plugins import get_registry

    key = (id(get_registry()), name)
    if key in _cache:
        return _cache[key]
    entry = registered("transports", name, error or ComposerPluginsError)
    transport = entry.build(name=entry.name)
    if not isinstance(transport, Transport):
        raise TypeError(
            f"transport {name!r} ({entry.provider or entry.plugin}) built a {type(transport).__name__}, not a "
            "composer_plugins.diloco.transports.Transport"
        )
    _cache[key] = transport
    return transport
