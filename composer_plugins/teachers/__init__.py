"""Built-in teachers of composer-plugins (registered by :mod:`composer_plugins.teachers.plugin`)."""
