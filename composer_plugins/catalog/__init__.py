"""What is installed, on the command line: ``composer-plugins list`` and ``composer-plugins plugins``
(:mod:`.commands`), over the kernel's registry and plugin manager. Imports only ``core``, click and the stdlib."""
