"""The distribution's version and the plugin contract's, in the kernel so that the kernel's own modules can read
them without importing the package root (which imports them: a circle)."""

from __future__ import annotations

__version__ = "0.2.3"

#: The plugin contract's version (docs/plugins.md "Versions and deprecations"): a new minor adds to it, a new
#: major changes it, the previous major served through adapters until ADAPTERS_REMOVED_IN. 2.0: ``forward(inputs)``.
PLUGIN_API_VERSION = "2.0"
OLDEST_PLUGIN_API = 1
ADAPTERS_REMOVED_IN = "0.3.0"


def _parts(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def adapters_served(version: str = __version__) -> bool:
    """True while the previous contract's adapters still work (before :data:`ADAPTERS_REMOVED_IN`)."""
    return _parts(version) < _parts(ADAPTERS_REMOVED_IN)


def api_problem(required: object) -> str | None:
    """Why a plugin that declares ``COMPOSER_PLUGINS_API = required`` (``"2"``, ``"2.0"``) cannot load, or ``None``."""
    if required is None:
        return None
    have, want = _parts(PLUGIN_API_VERSION), _parts(str(required))
    if not want:
        return f"COMPOSER_PLUGINS_API = {required!r} is not a version like '{PLUGIN_API_VERSION}'"
    if (want[0] == have[0] and want[1:2] <= have[1:2]) or (
        OLDEST_PLUGIN_API <= want[0] < have[0] and adapters_served()
    ):
        return None
    if want > have:
        return (
            f"needs plugin API {required} and composer-plugins {__version__} provides {PLUGIN_API_VERSION}. "
            "HINT: pip install -U composer-plugins"
        )
    return (
        f"was written for plugin API {required}; composer-plugins {__version__} provides {PLUGIN_API_VERSION} "
        f"(its adapters were removed in {ADAPTERS_REMOVED_IN}). HINT: upgrade the plugin, or pip install "
        f"'composer-plugins<{ADAPTERS_REMOVED_IN}'"
    )
