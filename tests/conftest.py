"""Shared fixtures: a fresh plugin manager per test, and isolation of the process-wide registry."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


@pytest.fixture
def fresh_pm():
    """A plugin manager with the built-in default plugins only (no entry points)."""
    from composer_plugins.core import plugins

    pm = plugins.make_plugin_manager(entrypoints=False)
    yield pm


@pytest.fixture
def isolated_plugins():
    """Reset the process-wide plugin manager before and after a test that changes it."""
    from composer_plugins.core import plugins

    plugins.reset()
    yield plugins
    plugins.reset()
