"""Built-in backends of composer-plugins (registered by :mod:`composer_plugins.backends.plugin`)."""
