"""Built-in envs of composer-plugins (registered by :mod:`composer_plugins.envs.plugin`)."""
