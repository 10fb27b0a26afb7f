"""The dispatcher's REST API under ``/v1``: jobs, episodes, tenants and keys."""
