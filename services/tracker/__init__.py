"""The tracker: logs the jobs that ask for it to their MLflow runs, from the ``events`` topic."""
