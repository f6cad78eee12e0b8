#!/bin/sh
# Container entry point: render the nginx config from the environment (see render-config.sh), then run nginx in
# the foreground as PID 1's replacement.
set -eu
conf=${WEBUI_TMP:-/tmp/nebula-webui}/nginx.conf
"$(dirname "$0")/render-config.sh" "$conf"
exec nginx -e stderr -c "$conf" -g 'daemon off;'
