"""The training config: the dataclasses of every section, each validating itself (``train``: ``TrainConfig``;
``sections``), the parsed loss specs, the strategy names and the channel-input declarations (``inputs``).

Imports nothing else of ``training`` at module level (the package root's deprecation helper aside); a section
checks a name against the registry of the sub-package that owns it, lazily
(tests/core/test_architecture.py lists those imports).
"""

from __future__ import annotations

from composer_plugins.training import forward_names

#: 0.2.0's ``composer_plugins.training.config`` was the module now at ``.train``: its names still resolve here, with a
#: deprecation warning naming the new path (until 0.3.0).
__getattr__ = forward_names(__name__, "train")
