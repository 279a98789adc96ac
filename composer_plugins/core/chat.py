"""Moved to :mod:`composer_plugins.chat.render`; this path warns until composer-plugins 0.3.0."""

from composer_plugins.core import moved_module

__getattr__ = moved_module(__name__, "composer_plugins.chat.render")
