#!/bin/sh
# The official postgres image's first start: initdb with POSTGRES_USER/PASSWORD/DB, then
# serve on every interface with password authentication.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pw="$(mktemp)"
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pw"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pw" --auth-host=scram-sha-256 --auth-local=trust >/dev/null
  rm -f "$pw"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  # initdb makes only "postgres"; the official image also makes POSTGRES_DB (default: the user).
  db="${POSTGRES_DB:-$POSTGRES_USER}"
  if [ "$db" != postgres ]; then
    createdb -U "$POSTGRES_USER" "$db"
  fi
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
