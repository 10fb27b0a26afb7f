"""The worker service: the Celery worker (and its beat schedule) for batch and periodic
work that is not a stream (``python -m services.worker worker|beat``)."""
