#!/bin/sh
# Renders nginx.conf.template (beside this script) into the file named by $1 from these environment variables:
#   NEBULA_API_URL    the API, scheme://host:port without a path      (default http://nebula:8090)
#   NEBULA_API_KEY    API key sent as "Authorization: Bearer …"        (default: none; the browser's header passes)
#   WEBUI_PORT        port nginx listens on                             (default 8080)
#   WEBUI_ROOT        the built app (index.html, assets/)               (default /usr/share/nebula-webui)
#   WEBUI_TMP         pid file and temp folders                         (default /tmp/nebula-webui)
#   WEBUI_ACCESS_LOG  access log path, or "off"                         (default /dev/stdout)
#   NGINX_RESOLVER    DNS server for the API's name                     (default: first nameserver of /etc/resolv.conf)
#   NGINX_MIME_TYPES  nginx's mime.types                                (default /etc/nginx/mime.types)
set -eu

out=${1:?usage: render-config.sh OUTPUT}
here=$(cd "$(dirname "$0")" && pwd)

NEBULA_API_URL=${NEBULA_API_URL:-http://nebula:8090}
WEBUI_PORT=${WEBUI_PORT:-8080}
WEBUI_ROOT=${WEBUI_ROOT:-/usr/share/nebula-webui}
WEBUI_TMP=${WEBUI_TMP:-/tmp/nebula-webui}
WEBUI_ACCESS_LOG=${WEBUI_ACCESS_LOG:-/dev/stdout}
NGINX_MIME_TYPES=${NGINX_MIME_TYPES:-/etc/nginx/mime.types}
WEBUI_CONF_DIR=$here

fail() { echo "render-config.sh: $*" >&2; exit 2; }

# Strip one trailing slash; the API paths are appended by nginx as requested.
NEBULA_API_URL=${NEBULA_API_URL%/}
echo "$NEBULA_API_URL" | grep -Eq '^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?$' ||
  fail "NEBULA_API_URL must look like http://host:port (no path, no quotes), got '$NEBULA_API_URL'"
echo "$WEBUI_PORT" | grep -Eq '^[0-9]{1,5}$' || fail "WEBUI_PORT must be a port number, got '$WEBUI_PORT'"
[ -f "$WEBUI_ROOT/index.html" ] || fail "WEBUI_ROOT=$WEBUI_ROOT has no index.html (was the app built?)"

if [ -n "${NEBULA_API_KEY:-}" ]; then
  echo "$NEBULA_API_KEY" | grep -Eq '^[A-Za-z0-9._~+/=-]+$' || fail "NEBULA_API_KEY may only hold token characters"
  NEBULA_API_AUTHORIZATION="Bearer $NEBULA_API_KEY"
else
  NEBULA_API_AUTHORIZATION='$http_authorization'
fi

host=$(echo "$NEBULA_API_URL" | sed -E 's#^https?://##; s#:[0-9]+$##')
if [ -z "${NGINX_RESOLVER:-}" ] && [ -r /etc/resolv.conf ]; then
  NGINX_RESOLVER=$(awk '$1 == "nameserver" { print $2; exit }' /etc/resolv.conf)
fi
case "${NGINX_RESOLVER:-}" in
  "") NGINX_RESOLVER_LINE="" ;;
  *:*) NGINX_RESOLVER_LINE="resolver [${NGINX_RESOLVER#[}] valid=10s; resolver_timeout 5s;" ;;
  *) NGINX_RESOLVER_LINE="resolver ${NGINX_RESOLVER} valid=10s; resolver_timeout 5s;" ;;
esac
NGINX_RESOLVER_LINE=$(echo "$NGINX_RESOLVER_LINE" | sed 's/\[\[/[/; s/\]\]/]/')
if [ -z "$NGINX_RESOLVER_LINE" ] && ! echo "$host" | grep -Eq '^([0-9.]+|\[.*\])$'; then
  fail "NEBULA_API_URL names a host ($host) but no DNS resolver is known: set NGINX_RESOLVER"
fi

mkdir -p "$WEBUI_TMP" "$(dirname "$out")"
export NEBULA_API_URL NEBULA_API_AUTHORIZATION WEBUI_PORT WEBUI_ROOT WEBUI_TMP WEBUI_ACCESS_LOG NGINX_MIME_TYPES \
  NGINX_RESOLVER_LINE WEBUI_CONF_DIR
# shellcheck disable=SC2016 # the names are for envsubst, not for the shell
envsubst '${NEBULA_API_URL} ${NEBULA_API_AUTHORIZATION} ${WEBUI_PORT} ${WEBUI_ROOT} ${WEBUI_TMP} ${WEBUI_ACCESS_LOG} ${NGINX_MIME_TYPES} ${NGINX_RESOLVER_LINE} ${WEBUI_CONF_DIR}' \
  <"$here/nginx.conf.template" >"$out"
echo "render-config.sh: $out: WebUI on :$WEBUI_PORT, API at $NEBULA_API_URL" >&2
