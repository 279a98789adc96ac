"""DiLoCo across replicas on torchft: the Lightning callback (``strategy``), the toy LM its tests and
benchmark train (``toy``) and the replica launcher with its lighthouse (``launch``).

Imports point down: ``core`` and ``training`` only.
"""
