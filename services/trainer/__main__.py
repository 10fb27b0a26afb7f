"""``python -m services.trainer``: the trainer on 127.0.0.1:8004 (``TEMPER_HOST``/``TEMPER_PORT``
to change). ``TEMPER_TRAINER__JOB_ID`` pins it to one job; ``TEMPER_TRAINER__DEVICE``
picks cpu/cuda (default: a GPU when one is visible).

Under ``torchrun --nproc-per-node N -m services.trainer`` rank 0 is this service and
the other ranks follow it (``services.trainer.follower``), every job's model sharded
over all of them with FSDP2."""

from services.trainer.app import create_app
from temper.runtime import run_service
from temper.training.distributed import world_from_env

if __name__ == "__main__":
    rank, world, _ = world_from_env()
    if world > 1 and rank > 0:
        from services.trainer.follower import main

        main()
    else:
        run_service(create_app, "trainer", 8004)
