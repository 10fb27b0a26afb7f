#!/bin/sh
# The apache/kafka image's interface: every KAFKA_FOO_BAR variable becomes foo.bar in
# server.properties; the storage is formatted once (KRaft) with CLUSTER_ID or a new id.
set -eu
CP="/opt/kafka/libs/*"
props=/tmp/server.properties
env | grep '^KAFKA_' | grep -v '^KAFKA_HEAP_OPTS=' | while IFS='=' read -r key value; do
  printf '%s=%s\n' "$(echo "${key#KAFKA_}" | tr 'A-Z_' 'a-z.')" "$value"
done >"$props"
logdir=$(sed -n 's/^log\.dirs=//p' "$props")
logdir=${logdir:-/var/lib/kafka/data}
if [ ! -f "$logdir/meta.properties" ]; then
  id=${CLUSTER_ID:-$(head -c16 /dev/urandom | base64 | tr '+/' '-_' | cut -c1-22)}
  java -Xmx128m -cp "$CP" kafka.tools.StorageTool format --ignore-formatted -t "$id" -c "$props"
fi
# shellcheck disable=SC2086
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} -XX:+UseG1GC -Djava.awt.headless=true \
  -cp "$CP" kafka.Kafka "$props"
