"""The distribution's version and the plugin contract's, in the kernel so that the kernel's own modules can read
them without importing the package root (which imports them: a circle)."""

from __future__ import annotations

__version__ = "0.2.0"

#: The plugin contract's version, ``major.minor``: a new minor adds to it, a new major changes it (the previous
#: major's form keeps working through adapters, with a ``DeprecationWarning``, for one minor release of the
#: package; docs/plugins.md "Versions and deprecations"). 2.0: a loss channel's ``forward(inputs)``.
PLUGIN_API_VERSION = "2.0"
#: The oldest contract major still served (through adapters); refused from :data:`ADAPTERS_REMOVED_IN` on.
OLDEST_PLUGIN_API = 1
#: The package release that drops the adapters of :data:`OLDEST_PLUGIN_API`.
ADAPTERS_REMOVED_IN = "0.3.0"


def _parts(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def adapters_served(version: str = __version__) -> bool:
    """True while the previous contract's adapters still work (before :data:`ADAPTERS_REMOVED_IN`)."""
    return _parts(version) < _parts(ADAPTERS_REMOVED_IN)


def api_problem(required: object) -> str | None:
    """Why a plugin that declares ``COMPOSER_PLUGINS_API = required`` cannot load here, or ``None``.

    ``"2"`` or ``"2.0"`` (any 2.x at least that minor) loads on 2.x; ``"1"`` loads while the 1.x adapters are
    served (deprecated); a newer major or minor asks for a newer composer-plugins."""
    if required is None:
        return None
    have = _parts(PLUGIN_API_VERSION)
    try:
        want = _parts(str(required))
        if not want:
            raise ValueError
    except ValueError:
        return f"COMPOSER_PLUGINS_API = {required!r} is not a version like '{PLUGIN_API_VERSION}'"
    if want[0] == have[0] and want[1:2] <= have[1:2]:
        return None
    if OLDEST_PLUGIN_API <= want[0] < have[0] and adapters_served():
        return None
    if want > have:
        return (
            f"needs plugin API {required} and composer-plugins {__version__} provides {PLUGIN_API_VERSION}. "
            "HINT: pip install -U composer-plugins"
        )
    return (
        f"was written for plugin API {required}; composer-plugins {__version__} provides {PLUGIN_API_VERSION} "
        f"(its adapters for {required} were removed in {ADAPTERS_REMOVED_IN}). HINT: upgrade the plugin, or "
        f"pip install 'composer-plugins<{ADAPTERS_REMOVED_IN}'"
    )
