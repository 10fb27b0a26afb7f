"""``python -m services.trainer``: the trainer on 127.0.0.1:8004 (``TEMPER_HOST``/``TEMPER_PORT``
to change). ``TEMPER_TRAINER__JOB_ID`` pins it to one job; ``TEMPER_TRAINER__DEVICE``
picks cpu/cuda (default: a GPU when one is visible)."""

from services.trainer.app import create_app
from temper.runtime import run_service

if __name__ == "__main__":
    run_service(create_app, "trainer", 8004)
