"""One RL step: the read-only step record (``record``), the experience maker (``experience``), the assembler of
with-grad channel inputs and its input builders (``assemble``, ``input_builders``, ``input_plugin``), teacher
scoring (``teacher_scores``), the policy and its settings (``policy``), the optimizers (``optim``), the EMA
teacher (``ema``), the step's metrics (``metrics``) and the one place a config becomes a step's components
(``components``), used by the Lightning module and every backend alike.

Imports ``training.config`` and ``training.rollout``.
"""

from __future__ import annotations

from composer_plugins.training import forward_names

#: 0.2.0's ``composer_plugins.training.step`` was the module now at ``.record``: its names still resolve here, with a
#: deprecation warning naming the new path (until 0.3.0).
__getattr__ = forward_names(__name__, "record")
