"""``python -m services.dispatcher``: the REST API, web console and episode state machine on
127.0.0.1:8000 (``TEMPER_HOST``/``TEMPER_PORT`` to change)."""

from services.dispatcher.app import create_app
from temper.runtime import run_service

if __name__ == "__main__":
    run_service(create_app, "dispatcher", 8000)
