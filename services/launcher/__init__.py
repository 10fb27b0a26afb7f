"""The multi-process launcher: every service its own process on the real stack (``python -m services.launcher``)."""
