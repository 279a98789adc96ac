"""Rollout: task streams and env rewards (``rewards``), rollout generators (``rollouts``, ``multiturn``), the chat
templates applied to every model input (``chat``) and the data-parallel rank helpers (``distributed``).

Imports ``training.config`` only.
"""
