"""``python -m composer_plugins``: the same command line as the ``composer-plugins`` console script."""

from composer_plugins.core.cli import main

if __name__ == "__main__":
    main()
