"""The training stack: config (``config``, ``sections``, ``loss_specs``), components (``builders``,
``components``), task streams (``batches``), rollout generators (``rollouts``, ``multiturn``), the read-only
step record (``step``), the experience maker and step computer (``experience``), the input assembler
(``assemble``, ``input_builders``), the Lightning glue (``module``), evaluation, SFT, tracking, runs and
commands. Imports point down: ``core``, ``procs``, ``losses``, ``models``, ``envs`` and ``teachers`` only.
"""
