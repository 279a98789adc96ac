"""DiLoCo across replicas on torchft: the Lightning callback and toy target (``strategy``) and
the replica launcher with its lighthouse (``launch``).

Imports point down: ``core`` and ``training`` only.
"""
