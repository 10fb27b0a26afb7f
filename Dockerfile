# One image for every Temper process. The command picks the process:
#   python -m services.<dispatcher|inference_gateway|sandbox_worker|reward_scorer|trainer>
#   python -m services.inference_gateway.cpu_server   (CPU inference engine, dev/test)
#   python -m temper.db.migrate                       (one-shot migrations)
#   python -m services.worker worker | beat           (the Celery worker and its schedule)
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# bubblewrap: the sandbox-worker's and reward-scorer's namespace sandboxes.
# curl: container health checks. tini: PID 1 that reaps orphans and forwards signals.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap curl tini \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 temper \
    && useradd --system --uid 10001 --gid temper --home-dir /home/temper --create-home temper

WORKDIR /app

# Dependencies first so that code edits do not reinstall them.
COPY pyproject.toml ./
RUN mkdir -p libs/temper services \
    && touch libs/temper/__init__.py services/__init__.py \
    && pip install . \
    && pip uninstall -y temper \
    && rm -rf libs services build *.egg-info

COPY libs ./libs
COPY services ./services
COPY migrations ./migrations
RUN pip install --no-deps . && rm -rf build *.egg-info

USER 10001:10001
ENV HOME=/home/temper \
    TEMPER_MODE=distributed \
    TEMPER_API__HOST=0.0.0.0 \
    TEMPER_DATA_DIR=/home/temper/.temper \
    TEMPER_MIGRATIONS_DIR=/app/migrations

EXPOSE 8000 8001 8002 8003 8004 8010
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python", "-m", "services.dispatcher"]
