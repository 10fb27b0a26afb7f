# Local stand-ins for the servers docker-compose.yml pulls from a registry (postgres:15,
# redis:7, apache/kafka:4.0, minio/minio, prom/prometheus), built from Debian bookworm's
# packages and the binaries the local stack already built (Kafka's jars, MinIO), for
# machines that reach no container registry. Each target keeps the official image's
# interface that docker-compose.yml relies on (environment, command, paths).
# Used only by deploy/compose/local-servers.yml; scripts/compose/build.sh builds them.
ARG BASE_IMAGE=temper-base:bookworm
FROM ${BASE_IMAGE} AS debian
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*

FROM debian AS postgres
RUN apt-get update \
    && apt-get install -y --no-install-recommends postgresql-15 \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
COPY deploy/compose/postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
USER postgres
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]

FROM debian AS redis
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
# As the official image: reachable from the other containers without a config file.
ENTRYPOINT ["/bin/sh", "-c", "shift; exec redis-server --protected-mode no --bind 0.0.0.0 \"$@\"", "--"]

FROM debian AS kafka
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 1000 --home-dir /opt/kafka appuser \
    && mkdir -p /var/lib/kafka/data && chown appuser /var/lib/kafka/data
COPY .docker/servers/kafka/libs /opt/kafka/libs
COPY deploy/compose/kafka-entrypoint.sh /opt/kafka/bin/kafka-entrypoint.sh
USER appuser
ENTRYPOINT ["/opt/kafka/bin/kafka-entrypoint.sh"]

FROM debian AS minio
COPY .docker/servers/minio /usr/local/bin/minio
RUN useradd --system --uid 1000 minio && mkdir -p /data && chown minio /data
USER minio
ENTRYPOINT ["/usr/local/bin/minio"]

FROM debian AS prometheus
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown prometheus /prometheus
USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
