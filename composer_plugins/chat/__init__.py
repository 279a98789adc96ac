"""What a model and an env say to each other, below every package that feeds a model or drives an env.

:mod:`.render`: the one renderer of a prompt (text, or chat messages through a chat template) into the text
a model reads, for the training stack and its backends, the teachers with their own tokenizers and the
envs; :mod:`.env_step`: the one reader of an ``env.step(...)`` result, for the rollouts, the trace recorder
and the conformance checks. Imports only the stdlib and ``core`` (``tests/core/test_architecture.py``).
"""
