"""The multi-process launcher: the ``temper run`` job with every service its own process
on the real stack (``python -m services.launcher SPEC``, ``make run-stack``)."""
