#!/usr/bin/env bash
# The documentation's pictures, made from a running pipeline rather than pasted by hand, with what Debian
# ships: Prometheus' own graph page of the pipeline's metrics, and one request's trace as `pipeline trace`
# draws it, both taken by headless Chromium.
#
#   scripts/screenshots.sh [OUT_DIR]        # default docs/assets/screenshots
#
# Needs `prometheus` and `chromium` (as root on Debian: apt-get install -y prometheus chromium; or set
# PROMETHEUS= and CHROMIUM= to their paths) and the project's virtual environment (`make install`). It starts
# `pipeline run` on ports the OS had free, every request traced to a file, and Prometheus scraping the router
# and the three stages every second; loads the digits ensemble for LOAD_SECONDS (default 60) with
# `pipeline bench`; takes the pictures; stops everything. It writes OUT_DIR/manifest.json, each picture's
# sha256 beside what it shows, which tests/unit/test_docs_pictures.py checks the pictures against. Users of
# Grafana have the dashboard in observability/grafana/dashboards/pipeline.json.
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-docs/assets/screenshots}
seconds=${LOAD_SECONDS:-60}
chromium=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
prometheus=${PROMETHEUS:-$(command -v prometheus || true)}
[ -n "$chromium" ] || { echo "screenshots: no Chromium found (apt-get install chromium, or set CHROMIUM)" >&2; exit 1; }
[ -n "$prometheus" ] || { echo "screenshots: no Prometheus found (apt-get install prometheus, or set PROMETHEUS)" >&2; exit 1; }
python=.venv/bin/python
[ -x "$python" ] || { echo "screenshots: run make install first" >&2; exit 1; }
work=$(mktemp -d)
pids=()

stop() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap stop EXIT

# Six ports free now: the router's gRPC and metrics, the three stages' metrics, Prometheus.
read -r router router_metrics pre_metrics model_metrics post_metrics prom < <("$python" -c "
import socket
sockets = [socket.socket() for _ in range(6)]
for s in sockets:
    s.bind(('127.0.0.1', 0))
print(*(s.getsockname()[1] for s in sockets))
")

shoot() {  # shoot URL FILE: a 1400x1250 picture once the page's scripts have had 10 s of virtual time
    "$chromium" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
        --no-first-run --user-data-dir="$work/chromium" --hide-scrollbars --window-size=1400,1250 \
        --virtual-time-budget=10000 --screenshot="$2" "$1" >/dev/null 2>&1
    [ -s "$2" ] || { echo "screenshots: no picture of $1" >&2; exit 1; }
    echo "screenshots: $2"
}

wait_for() {  # wait_for URL: until it answers, up to 5 minutes (the first run builds the example models)
    for _ in $(seq 300); do
        "$python" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=1)" "$1" 2>/dev/null &&
            return 0
        sleep 1
    done
    echo "screenshots: $1 did not answer" >&2
    exit 1
}

echo "screenshots: building the example models that are missing"
"$python" -m examples.models.build --model-dir model_repository --missing >/dev/null
"$python" -m examples.digit_images "$work" >/dev/null

echo "screenshots: starting the pipeline (every request traced) and Prometheus"
OTEL_TRACES_EXPORTER=jsonl PIPELINE_TRACE_FILE="$work/traces.jsonl" \
    PIPELINE_PREPROCESS_METRICS_PORT=$pre_metrics PIPELINE_MODEL_METRICS_PORT=$model_metrics \
    PIPELINE_POSTPROCESS_METRICS_PORT=$post_metrics \
    .venv/bin/pipeline run --port "$router" --http-port off --metrics-port "$router_metrics" \
    >"$work/pipeline.log" 2>&1 &
pids+=($!)
cat >"$work/prometheus.yml" <<EOF
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: pipeline
    static_configs:
      - targets: ["127.0.0.1:$router_metrics"]
        labels: {service: router}
      - targets: ["127.0.0.1:$pre_metrics"]
        labels: {service: preprocess}
      - targets: ["127.0.0.1:$model_metrics"]
        labels: {service: model}
      - targets: ["127.0.0.1:$post_metrics"]
        labels: {service: postprocess}
EOF
"$prometheus" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$prom" >"$work/prometheus.log" 2>&1 &
pids+=($!)
wait_for "http://127.0.0.1:$router_metrics/metrics"
wait_for "http://127.0.0.1:$prom/-/ready"

echo "screenshots: loading digits for $seconds s"
.venv/bin/pipeline bench --url "127.0.0.1:$router" --model digits --input-file "IMAGE=$work/three.png" \
    --concurrency 8 --warmup 5 --duration "$seconds" --no-progress >"$work/bench.txt"
tail -4 "$work/bench.txt"
sleep 3  # two more scrapes, so the graphs end with the load

mkdir -p "$out"
# Prometheus' graph page (the classic one, which Debian ships): two panels over the last two minutes, stacked
# (g0, g1 of its URL).
panel() {  # panel N EXPR: the URL parameters of one graph panel
    "$python" -c "import sys, urllib.parse as u; n, e = sys.argv[1:]; print(f'g{n}.expr={u.quote(e)}&g{n}.tab=0&g{n}.range_input=2m')" "$@"
}
graph="http://127.0.0.1:$prom/classic/graph?$(panel 0 'sum by (model) (rate(pipeline_requests_total{service="router"}[10s]))')"
graph+="&$(panel 1 'histogram_quantile(0.95, sum by (le, model) (rate(pipeline_request_duration_seconds_bucket{service="router"}[10s])))')"
shoot "$graph" "$out/prometheus-graphs.png"

# The last request's trace, drawn by `pipeline trace`.
.venv/bin/pipeline trace "$work/traces.jsonl" --last --png "$out/trace.png" >"$work/trace.txt"
[ -s "$out/trace.png" ] || { echo "screenshots: pipeline trace drew nothing" >&2; exit 1; }
echo "screenshots: $out/trace.png"

"$python" - "$out" "$seconds" <<'EOF'
"""The manifest: each picture's sha256 and what it shows, for the test that checks the pictures."""
import hashlib, json, pathlib, sys

out, seconds = pathlib.Path(sys.argv[1]), sys.argv[2]
shows = {
    "prometheus-graphs.png": "Prometheus' graph page: requests/s and p95 latency of each model at "
    f"the router, over {seconds} s of `pipeline bench --concurrency 8` on digits",
    "trace.png": "one digits request's trace, drawn by `pipeline trace --last --png`",
}
pictures = {
    name: {"sha256": hashlib.sha256((out / name).read_bytes()).hexdigest(), "shows": text}
    for name, text in shows.items()
}
manifest = {"made_by": "scripts/screenshots.sh", "pictures": pictures}
(out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
print(f"screenshots: {out / 'manifest.json'}")
EOF
