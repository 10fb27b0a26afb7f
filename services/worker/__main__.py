"""``python -m services.worker [worker|beat|...]``: the Celery worker (the default) or,
with ``beat``, its schedule; arguments are Celery's (``python -m services.worker worker
-l INFO --concurrency 2``)."""

import sys

from services.worker.app import app

if __name__ == "__main__":
    app.start(argv=sys.argv[1:] or ["worker"])
