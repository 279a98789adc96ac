"""The names ``trainer.strategy`` accepts, checked when the config loads (no Lightning import for the shorthands)."""

from __future__ import annotations

from composer_plugins.core.config import Config
from composer_plugins.core.errors import ConfigError, closest

#: Strategy names known without importing Lightning.
STRATEGY_SHORTHANDS: tuple[str, ...] = ("auto", "ddp", "fsdp")


def strategy_names() -> list[str]:
    """Every name ``trainer.strategy`` accepts (Lightning's registry + ``auto``/``ddp``/``fsdp``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return sorted({*STRATEGY_SHORTHANDS, *StrategyRegistry.available_strategies()})


def unknown_strategy(name: str, src: Config, key: str) -> ConfigError:
    """The located error of a ``trainer.strategy`` no one registered (valid names, did-you-mean, class paths)."""
    valid = strategy_names()
    sugg = closest(name.strip().lower(), valid)
    hint = f" Did you mean: {', '.join(repr(x) for x in sugg)}?" if sugg else ""
    return src.error(key, f"unknown strategy {name!r}.{hint} Or give a class path (a.b.MyStrategy).", valid=valid)
