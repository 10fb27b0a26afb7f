"""sandbox-worker: runs agent actions in isolated sandboxes (``python -m services.sandbox_worker``)."""
