#!/usr/bin/env bash
# The documentation's screenshots, made from a running stack rather than pasted by hand: the Grafana
# dashboard during a load run, and one request's trace in Jaeger.
#
#   scripts/screenshots.sh [OUT_DIR]        # default docs/assets/screenshots
#
# Needs Docker with Compose v2, a registry for the Grafana and Jaeger images (compose.observability.yaml),
# headless Chromium (CHROMIUM=path, else chromium, chromium-browser or google-chrome on the PATH), and the
# project's virtual environment (`make install`) for the load. It starts the observability profile with
# every request traced, loads the digits ensemble for a minute with `pipeline bench`, takes the screenshots,
# and stops the stack (KEEP=1 leaves it running). The pages that show the images reference them from
# docs/assets/screenshots/.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-docs/assets/screenshots}
chromium=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
[ -n "$chromium" ] || { echo "screenshots: no Chromium found (set CHROMIUM)" >&2; exit 1; }
python=.venv/bin/python
[ -x "$python" ] || { echo "screenshots: run make install first" >&2; exit 1; }
router=127.0.0.1:${PIPELINE_ROUTER_PUBLISHED_PORT:-8001}
grafana=http://127.0.0.1:${PIPELINE_GRAFANA_PUBLISHED_PORT:-3000}
jaeger=http://127.0.0.1:${PIPELINE_JAEGER_PUBLISHED_PORT:-16686}
compose=(docker compose -f compose.yaml -f compose.observability.yaml --profile observability)
work=$(mktemp -d)

stop() {
    rm -rf "$work"
    if [ "${KEEP:-0}" != 1 ]; then "${compose[@]}" down --remove-orphans >/dev/null 2>&1 || true; fi
}
trap stop EXIT

shoot() {  # shoot URL FILE: a 1600x1000 screenshot once the page's scripts have had 15 s of virtual time
    "$chromium" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1000 \
        --virtual-time-budget=15000 --screenshot="$2" "$1" >/dev/null 2>&1
    [ -s "$2" ] || { echo "screenshots: no image of $1" >&2; exit 1; }
    echo "screenshots: $2"
}

wait_for() {  # wait_for URL: until it answers, up to 3 minutes
    for _ in $(seq 180); do
        curl -fsS -o /dev/null "$1" && return 0
        sleep 1
    done
    echo "screenshots: $1 did not answer" >&2
    exit 1
}

echo "screenshots: starting the observability profile (every request traced)"
OTEL_TRACES_SAMPLER_ARG=1 "${compose[@]}" up -d --build --wait
wait_for "$grafana/api/health"
wait_for "$jaeger/"

echo "screenshots: loading digits for 60 s"
"$python" -c "
from examples.models.digits import load_split
from tests.e2e.conftest import encode
_, _, x_test, y_test = load_split()
open('$work/three.png', 'wb').write(encode(x_test[list(y_test).index(3)], scale=4))
"
"$python" -m pipeline bench --url "$router" --model digits --input-file "IMAGE=$work/three.png" \
    --concurrency 8 --warmup 5 --duration 60 --no-progress >"$work/bench.txt"
tail -4 "$work/bench.txt"

mkdir -p "$out"
shoot "$grafana/d/pipeline-overview/?orgId=1&from=now-5m&to=now&kiosk" "$out/grafana-dashboard.png"
trace=$(curl -fsS "$jaeger/api/traces?service=pipeline-router&limit=1&lookback=10m" |
    "$python" -c "import json, sys; print(json.load(sys.stdin)['data'][0]['traceID'])")
shoot "$jaeger/trace/$trace?uiEmbed=v0" "$out/jaeger-trace.png"
