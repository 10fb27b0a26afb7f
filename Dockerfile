# One image for every Temper process. The command picks the process:
#   python -m services.<dispatcher|inference_gateway|sandbox_worker|reward_scorer|trainer>
#   python -m services.inference_gateway.cpu_server   (CPU inference engine, dev/test)
#   python -m temper.db.migrate                       (one-shot migrations)
#   python -m services.worker worker | beat           (the Celery worker and its schedule)
#
# Python packages come only from a wheelhouse built on the host from requirements.lock
# (scripts/compose/wheelhouse.sh -> .docker/wheels) and are installed with --no-index:
# the build needs no Python index. `make image` does both steps.
#   BASE_IMAGE: python:3.11-slim (default), or any Debian bookworm image
#   (scripts/compose/base_image.sh makes one where no registry is reachable; Debian's
#   python3 is 3.11, the version the wheels are built for).
ARG BASE_IMAGE=python:3.11-slim

# --- runtime: what every stage and the final image share ---------------------------------
FROM ${BASE_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# bubblewrap: the sandbox-worker's and reward-scorer's namespace sandboxes.
# curl: container health checks. tini: PID 1 that reaps orphans and forwards signals.
# python3 + python3-venv only where the base has no Python 3.11 (a plain Debian base).
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap curl tini ca-certificates \
    && if ! command -v python3.11 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-venv; fi \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 temper \
    && useradd --system --uid 10001 --gid temper --home-dir /home/temper --create-home temper

# --- build: the virtual environment, from the wheelhouse only -----------------------------
FROM runtime AS build
COPY requirements.lock /tmp/requirements.lock
COPY .docker/wheels /wheels
RUN python3.11 -m venv /opt/venv \
    && /opt/venv/bin/pip install -q --no-index --find-links /wheels -r /tmp/requirements.lock
WORKDIR /app
COPY pyproject.toml ./
COPY libs ./libs
COPY services ./services
# Temper itself: no dependency resolution, no build isolation (setuptools is in the lock).
RUN /opt/venv/bin/pip install -q --no-index --no-deps --no-build-isolation . \
    && rm -rf build libs/*.egg-info *.egg-info

# --- final: no compilers, no wheelhouse, no pip cache ------------------------------------
FROM runtime
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# The sources as well, first on the path: the console's templates and static files are not
# package data of the installed wheel; the installed metadata keeps the plugin entry points.
COPY libs ./libs
COPY services ./services
COPY migrations ./migrations
USER 10001:10001
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app/libs:/app \
    HOME=/home/temper \
    TEMPER_MODE=distributed \
    TEMPER_HOST=0.0.0.0 \
    TEMPER_DATA_DIR=/home/temper/.temper \
    TEMPER_MIGRATIONS_DIR=/app/migrations

EXPOSE 8000 8001 8002 8003 8004 8010
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python", "-m", "services.dispatcher"]
