"""``python -m services.tracker``: the tracker on 127.0.0.1:8005 (``TEMPER_HOST``/``TEMPER_PORT``
to change)."""

from services.tracker.app import create_app
from temper.runtime import run_service

if __name__ == "__main__":
    run_service(create_app, "tracker", 8005)
