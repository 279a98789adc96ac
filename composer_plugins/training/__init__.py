"""The training stack: config and its validation (``config``, ``limits``), building components (``builders``),
task streams (``batches``), rollout generators (``rollouts``, ``multiturn``), one step's data (``step``:
``StepRecord``) and the one assembler of channel inputs (``assemble``), the Lightning step (``module``:
``ComposerModule``), evaluation (``evaluation``), SFT (``sft``), MLflow tracking (``tracking``), the runs
(``run``) and the ``train``/``sft``/``eval`` commands (``commands``).

Imports point down: ``core``, ``procs``, ``losses``, ``models``, ``envs`` and ``teachers`` only.
"""
