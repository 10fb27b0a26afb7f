"""The Celery worker: batch and periodic work that is not a stream."""
