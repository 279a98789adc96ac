"""Backends of composer-plugins: the built-in ``lightning`` one and what every backend shares.

- :mod:`~composer_plugins.backends.lightning`: the native ``ComposerModule`` path (registered by
  :mod:`composer_plugins.backends.plugin`, which also adds ``composer-plugins backend info|run|export``);
- :mod:`~composer_plugins.backends.base`: the ``Backend`` base class (the ``max_steps`` override, the one local
  loop ``run_local`` and the one ``optimizer_step`` of every backend's local mode), config loading, metrics;
- :mod:`~composer_plugins.backends.rollout`: the in-process step components (``StepComponents.from_config``),
  task draws and rollouts an upstream backend reuses;
- :mod:`~composer_plugins.backends.support`: which channel runs in which backend mode (the table of
  ``docs/backends.md``), and ``check_channels``, the build-time refusal of a channel a mode cannot run.

The backends that need an upstream library ship in their own distributions, each registering its
backend through its own ``composer_plugins`` entry point: ``composer-plugins-trl``
(``composer_plugins_trl``), ``composer-plugins-verl``, ``composer-plugins-prime-rl`` and
``composer-plugins-monarch``. See ``docs/backends.md``.
"""
