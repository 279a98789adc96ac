"""Core machinery: hookspecs, plugin manager, registry, errors, config and CLI."""
