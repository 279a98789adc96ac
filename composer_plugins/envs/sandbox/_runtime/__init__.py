"""Trusted programs copied into every sandbox (never imported by composer_plugins itself).

* ``launcher.py``: first program run in the sandbox: mounts, privilege drop, rlimits, exec.
* ``sitecustomize.py``: audit-hook guard (network, hidden paths, process budget, import guard).
* ``_cp_channel.py``: the nonce-authenticated result channel back to the parent.
* ``code_harness.py``: runs a HumanEval-style program and its tests, reporting each test.
* ``cp_pytest_reporter.py``: pytest plugin that reports each test outcome and checks integrity.
"""
