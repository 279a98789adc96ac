"""The example loss plugin's own tests: composer-plugins' conformance checks, in one line.

Run them with ``pytest examples/composer-plugins-focal`` (the package need not be installed: the
module is registered on a fresh plugin manager beside the built-ins).
"""

import composer_plugins_focal

from composer_plugins.testing import conformance_test

test_conformance = conformance_test(composer_plugins_focal)
