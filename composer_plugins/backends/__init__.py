"""Built-in backends of composer-plugins (registered by :mod:`composer_plugins.backends.plugin`).

One module per backend, each imported only when that backend is used:

- :mod:`~composer_plugins.backends.lightning`: the native ``ComposerModule`` path;
- :mod:`~composer_plugins.backends.trl`: ``ComposerGRPOTrainer``, a ``trl.GRPOTrainer`` whose loss is the channels;
- :mod:`~composer_plugins.backends.verl`: our losses in VeRL's ``core_algos`` registries;
- :mod:`~composer_plugins.backends.prime_rl`: a PRIME-RL ``[trainer.loss] type = "custom"`` loss;
- :mod:`~composer_plugins.backends.monarch`: Generator / Rewarder / Trainer actors on a Monarch mesh.

See ``docs/backends.md``.
"""
