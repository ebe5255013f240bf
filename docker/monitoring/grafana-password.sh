#!/usr/bin/env bash
# Grafana's admin password for `make monitor`: GRAFANA_ADMIN_PASSWORD when it is set; otherwise the one kept in
# FOLDER/grafana-admin-password, generated there the first time (192 random bits as 48 hex digits, the file
# readable and writable by its owner alone) and reused by every later start. Says where the password is, never
# the password itself.
#
#   docker/monitoring/grafana-password.sh out/monitoring
set -euo pipefail

folder=${1:?usage: grafana-password.sh FOLDER (where the password file is kept)}
file="$folder/grafana-admin-password"
if [[ -n "${GRAFANA_ADMIN_PASSWORD:-}" ]]; then
  echo "Grafana: user admin, the password GRAFANA_ADMIN_PASSWORD gives"
  exit 0
fi
mkdir -p "$folder"
if [[ -s "$file" ]]; then
  chmod 600 "$file"  # owner only, even if it was loosened since
  echo "Grafana: user admin, password in $file"
  exit 0
fi
umask 077
tmp=$(mktemp "$folder/.grafana-admin-password.XXXXXX")
od -An -tx1 -N24 /dev/urandom | tr -d ' \n' > "$tmp"
mv "$tmp" "$file"  # whole or not at all
echo "Grafana: user admin, password generated into $file (readable by you alone; later starts reuse it)"
