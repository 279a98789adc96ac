"""Built-in losses of composer-plugins (registered by :mod:`composer_plugins.losses.plugin`)."""
