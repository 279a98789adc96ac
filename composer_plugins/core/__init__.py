"""The plugin kernel: hookspecs, plugin manager, registry, errors, config, the JSONL and env-step readers,
the CLI group and its error handler, and progress bars (child processes: :mod:`composer_plugins.procs`).

Imports only the stdlib, pluggy, yaml and click (``tests/core/test_architecture.py``; see docs/architecture.md).
"""
