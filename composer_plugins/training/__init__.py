"""The training stack: config and its validation (``config``, ``sections``, ``loss_specs``), building components
(``builders``), task streams (``batches``), rollout generators (``rollouts``, ``multiturn``), one step's read-only
record (``step``: ``StepRecord`` with its row operations, ``StepMeta`` apart), the one experience maker and the one
step computer (``experience``), the one assembler of channel inputs (``assemble``) with its built-in input
builders (``input_builders``, registered by the ``input_plugin`` default plugin through the
``register_input_builders`` hook), the Lightning glue (``module``: ``ComposerModule``), evaluation
(``evaluation``), SFT (``sft``), MLflow tracking (``tracking``), the runs (``run``) and the
``train``/``sft``/``eval`` commands (``commands``).

Imports point down: ``core``, ``procs``, ``losses``, ``models``, ``envs`` and ``teachers`` only.
"""
