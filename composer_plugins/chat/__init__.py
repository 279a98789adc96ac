"""What a model and an env say to each other, below every package that feeds a model or drives an env.

:mod:`.render` (the one renderer of a prompt into the text a model reads) and :mod:`.env_step` (the one reader
of an ``env.step(...)`` result). Imports only the stdlib and ``core`` (``tests/core/test_architecture.py``).
"""
