#!/usr/bin/env bash
# CI for the containers: install Docker's engine if missing, build the images offline, start the pipeline
# with Compose and tokens on, classify digits through the router from the host with Triton's client and
# with the Go client of examples/go, scale preprocess and model to two replicas and show all serve, start
# Prometheus (the observability profile) and check during a bench run that it scrapes every replica and that
# every query of the Grafana dashboard returns data, stop a preprocess replica and kill a model replica
# (SIGKILL) under load and check no request failed, tear down, and run the scaling benchmark's Compose mode.
# Prints each step's time. About 5 minutes from nothing on 2 cores (most of it the first image build).
#
#   bash scripts/ci-docker.sh            # as root on a Debian machine (CI here), from anywhere
#
# Env: PYTHON (default .venv/bin/python: has tritonclient[grpc] and scikit-learn; `make install` makes it),
#      COMPOSE_PROJECT_NAME (default pipelineci), PIPELINE_ROUTER_PUBLISHED_PORT (default 18001),
#      PIPELINE_HTTP_PUBLISHED_PORT (default 18000),
#      PIPELINE_PROMETHEUS_PUBLISHED_PORT (default 19090),
#      KEEP_UP=1 leaves the pipeline running at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-pipelineci}
export PIPELINE_ROUTER_PUBLISHED_PORT=${PIPELINE_ROUTER_PUBLISHED_PORT:-18001}
export PIPELINE_HTTP_PUBLISHED_PORT=${PIPELINE_HTTP_PUBLISHED_PORT:-18000}
export PIPELINE_PROMETHEUS_PUBLISHED_PORT=${PIPELINE_PROMETHEUS_PUBLISHED_PORT:-19090}
# The router looks the stages' names up every 2 s here (5 s by default), so it finds a new replica quickly.
export PIPELINE_RESOLVE_INTERVAL_S=${PIPELINE_RESOLVE_INTERVAL_S:-2}
# Tokens on, as in production: the clients below send theirs, the router calls the stages with its own.
random_token() { od -An -N16 -tx1 /dev/urandom | tr -d ' \n'; }
export PIPELINE_AUTH_TOKENS=${PIPELINE_AUTH_TOKENS:-$(random_token)}
export PIPELINE_STAGE_TOKEN=${PIPELINE_STAGE_TOKEN:-$(random_token)}
export CLIENT_TOKEN=${PIPELINE_AUTH_TOKENS%%,*}
PYTHON=${PYTHON:-.venv/bin/python}
ROUTER=127.0.0.1:$PIPELINE_ROUTER_PUBLISHED_PORT
PROMETHEUS=http://127.0.0.1:$PIPELINE_PROMETHEUS_PUBLISHED_PORT
work=$(mktemp -d)
ci_start=$(date +%s)

say() { printf '\nci-docker: %s\n' "$*"; }
die() { printf '\nci-docker: FAILED: %s\n' "$*" >&2; exit 1; }

declare -a timings=()
step_name="" step_start=0
step() {
    step_end
    step_name=$1 step_start=$(date +%s)
    say "== $step_name"
}
step_end() {
    if [[ -n "$step_name" ]]; then
        timings+=("$(printf '%5ss  %s' $(($(date +%s) - step_start)) "$step_name")")
        step_name=""
    fi
}

started_dockerd=""
compose_up=""
finish() {
    local code=$?
    step_end
    if [[ -n "$compose_up" && "${KEEP_UP:-0}" != 1 ]]; then
        if ((code != 0)); then
            say "logs of the failed run (last 40 lines per service):"
            $COMPOSE ps || true
            $COMPOSE logs --no-color --tail=40 || true
        fi
        say "== teardown: compose down -v"
        $COMPOSE --profile observability down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
    if [[ -n "$started_dockerd" ]]; then
        kill "$started_dockerd" 2>/dev/null || true
        wait "$started_dockerd" 2>/dev/null || true
    fi
    say "step times:"
    printf '  %s\n' "${timings[@]}"
    printf '  %5ss  total\n' $(($(date +%s) - ci_start))
    if ((code == 0)); then say "all container checks passed"; else say "FAILED (exit $code)"; fi
    exit "$code"
}
trap finish EXIT

[[ -x "$PYTHON" ]] || die "no $PYTHON with tritonclient: run 'make install' first (or set PYTHON)"

# --- 1. the engine ---------------------------------------------------------------------------------------
# And Debian's Go toolchain, gRPC and protobuf for Go, and protoc: the Go client is built offline from them.
# (protobuf's APIv1 at 1.5: gRPC's codec under 1.3 cannot marshal the messages protoc-gen-go writes today.)
go_packages=(golang-go golang-google-grpc-dev golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev
    protoc-gen-go protoc-gen-go-grpc protobuf-compiler)
step "engine: Docker and Compose (and the Go client's toolchain)"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null \
    || ! { command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1; } \
    || ! dpkg -s "${go_packages[@]}" >/dev/null 2>&1; then
    [[ $(id -u) == 0 ]] || die "not installed and this is not root: apt-get install docker.io docker-compose debootstrap ${go_packages[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap "${go_packages[@]}" >/dev/null
fi
start_dockerd() {
    nohup dockerd >/tmp/ci-dockerd.log 2>&1 &
    started_dockerd=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return 0; sleep 0.5; done
    return 1
}
if ! docker info >/dev/null 2>&1; then
    say "starting dockerd in the background (log: /tmp/ci-dockerd.log)"
    if ! start_dockerd; then
        # A dockerd that was killed may leave its network store half written, and the next one then
        # panics while restoring it: networks are made anew by Compose, so start once more without it.
        kill "$started_dockerd" 2>/dev/null || true
        wait "$started_dockerd" 2>/dev/null || true
        say "dockerd did not start; once more without its saved network state"
        rm -f /var/lib/docker/network/files/local-kv.db
        start_dockerd || { tail -20 /tmp/ci-dockerd.log >&2; die "dockerd did not start within 30s"; }
    fi
fi
if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE="docker-compose"; fi
say "engine $(docker version -f '{{.Server.Version}}'), compose: $($COMPOSE version --short 2>/dev/null || $COMPOSE version | head -1)"
# A previous run's leftovers (an interrupted CI) would hold the port.
$COMPOSE --profile observability down -v --remove-orphans >/dev/null 2>&1 || true

# --- 2. the base image, made locally (no registry here) ------------------------------------------------
step "base image (debootstrap + docker import; skipped when present)"
bash scripts/offline-base-image.sh

# --- 3. the images -------------------------------------------------------------------------------------
step "build the images (Prometheus' too)"
$COMPOSE --profile observability build >/tmp/ci-docker-build.log 2>&1 || { tail -40 /tmp/ci-docker-build.log >&2; die "compose build failed (log above)"; }
docker image prune -f >/dev/null # the intermediate build stages
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^pipeline-' | sed 's/^/  image /'

# --- 4. up and healthy ---------------------------------------------------------------------------------
# All containers of the project healthy (Compose v1 has no `up --wait`; do it by hand for both).
wait_healthy() {
    local want=$1 deadline=$(($(date +%s) + 180)) states
    while true; do
        states=$(docker ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
            | xargs -r docker inspect -f '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}')
        if [[ $(grep -c ' healthy$' <<<"$states") -ge $want && $(grep -vc ' healthy$' <<<"$states") == 0 ]]; then
            return 0
        fi
        (($(date +%s) < deadline)) || { printf '%s\n' "$states" >&2; die "containers not healthy within 180s"; }
        sleep 1
    done
}
step "the example models' files in ./model_repository (the repository every service mounts)"
"$PYTHON" -m examples.models.build --model-dir model_repository --missing --no-progress

step "compose up; wait until every container is healthy"
compose_up=1
$COMPOSE up -d
wait_healthy 4
$COMPOSE ps

# --- 5. classify through the router from the host -------------------------------------------------------
# Triton's client runs in a process of its own (it cannot share one with pipeline._gen).
step "classify digits through the router with tritonclient"
"$PYTHON" - "$ROUTER" <<'EOF'
import io
import os
import sys

import numpy as np
import tritonclient.grpc as triton
from PIL import Image
from sklearn.datasets import load_digits

digits = load_digits()
count = 200
pngs = []
for pixels in digits.images[-count:]:  # 8x8, 0..16: dark ink on light paper, scaled up
    grey = (255 - pixels * 255 / 16).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(grey).resize((28, 28), Image.NEAREST).save(buffer, format="PNG")
    pngs.append(buffer.getvalue())
client = triton.InferenceServerClient(sys.argv[1])
assert client.is_server_ready(), "router not ready"
token = {"authorization": f"Bearer {os.environ['CLIENT_TOKEN']}"}
one = triton.InferInput("IMAGE", [1, 1], "BYTES")
one.set_data_from_numpy(np.array([[pngs[0]]], dtype=np.object_))
try:
    client.infer("digits", [one], client_timeout=30)
    raise AssertionError("the router answered a request without a token")
except triton.InferenceServerException as err:
    assert "UNAUTHENTICATED" in str(err.status()), err
labels = []
for start in range(0, count, 50):
    batch = np.array([[png] for png in pngs[start : start + 50]], dtype=np.object_)
    image = triton.InferInput("IMAGE", list(batch.shape), "BYTES")
    image.set_data_from_numpy(batch)
    result = client.infer("digits", [image], client_timeout=30, headers=token)
    labels.extend(result.as_numpy("LABEL").reshape(-1).tolist())
accuracy = float(np.mean(np.array(labels) == digits.target[-count:]))
print(f"classified {count} digits through the router: accuracy {accuracy:.1%}; first ten {labels[:10]}")
assert accuracy >= 0.9, f"accuracy {accuracy:.1%} is below 90%"
EOF

# --- 5b. the Go client, built offline from protos/ with Debian's packages --------------------------------
step "build the Go client (examples/go) and classify digits through the router with it"
examples/go/build.sh "$work/digits-client"
"$PYTHON" - "$work/digits" <<'EOF'
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

folder = Path(sys.argv[1])
folder.mkdir()
digits = load_digits()
for i in range(1, 41):  # 8x8, 0..16: dark ink on light paper, scaled up; the label in the name
    grey = (255 - digits.images[-i] * 255 / 16).astype(np.uint8)
    Image.fromarray(grey).resize((32, 32), Image.NEAREST).save(folder / f"{i:02d}-label{digits.target[-i]}.png")
EOF
"$work/digits-client" -url "$ROUTER" -token "$CLIENT_TOKEN" "$work"/digits/*.png >"$work/go-client.txt" || die "the Go client failed"
head -12 "$work/go-client.txt" | sed 's/^/  /'
grep -q '^config: digits platform ensemble max_batch_size 64$' "$work/go-client.txt" || die "the Go client read no ensemble config"
[[ $(grep -c '^  step ' "$work/go-client.txt") == 3 ]] || die "the Go client did not list the ensemble's 3 steps"
grep -q '^  input  IMAGE BYTES \[-1 1\]$' "$work/go-client.txt" || die "the Go client read no metadata"
right=$(grep -cE 'label([0-9])\.png: digit \1 ' "$work/go-client.txt" || true)
say "the Go client classified $right of 40 digits right"
((right >= 36)) || die "the Go client's accuracy is below 90% ($right of 40)"

# --- 6. two preprocess replicas, both serving -----------------------------------------------------------
# Per-replica counts: inside the router's container (on the stages' network), resolve `preprocess` to every
# replica's address and ask each for ModelStatistics.
# The stages ask for a token too: the router's (its container has it).
replica_counts() {  # SERVICE PORT MODEL
    $COMPOSE exec -T router python - "$@" <<'EOF'
import json
import os
import socket
import sys

import grpc

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

service, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
addresses = sorted({info[4][0] for info in socket.getaddrinfo(service, port, proto=socket.IPPROTO_TCP)})
token = (("authorization", f"Bearer {os.environ['PIPELINE_STAGE_TOKEN']}"),)
counts = {}
for address in addresses:
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics(
            pb.ModelStatisticsRequest(name=model), timeout=5, metadata=token
        )
        counts[address] = sum(stats.inference_count for stats in reply.model_stats)
print(json.dumps(counts))
EOF
}

# Closed-loop load from the host for a bounded time: DURATION seconds, THREADS threads, one image per
# request; prints a JSON summary and fails if any request failed.
load() {
    "$PYTHON" - "$ROUTER" "$@" <<'EOF'
import io
import json
import os
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as triton
from PIL import Image

router, duration, threads = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
grey = np.full((28, 28), 255, np.uint8)
grey[6:22, 12:16] = 0  # a one
buffer = io.BytesIO()
Image.fromarray(grey).save(buffer, format="PNG")
batch = np.array([[buffer.getvalue()]], dtype=np.object_)
ok, failed, lock = [0], [], threading.Lock()
token = {"authorization": f"Bearer {os.environ['CLIENT_TOKEN']}"}
stop = time.monotonic() + duration


def worker() -> None:
    client = triton.InferenceServerClient(router)
    image = triton.InferInput("IMAGE", list(batch.shape), "BYTES")
    image.set_data_from_numpy(batch)
    while time.monotonic() < stop:
        try:
            client.infer("digits", [image], client_timeout=10, headers=token)
            with lock:
                ok[0] += 1
        except Exception as err:  # every failure counts: the checks say no request may fail
            with lock:
                failed.append(str(err)[:200])


pool = [threading.Thread(target=worker) for _ in range(threads)]
for thread in pool:
    thread.start()
for thread in pool:
    thread.join()
print(json.dumps({"ok": ok[0], "failed": len(failed), "errors": sorted(set(failed))[:5]}))
sys.exit(1 if failed or not ok[0] else 0)
EOF
}

PREPROCESS=(preprocess "${PIPELINE_PREPROCESS_PORT:-8101}" digits_preprocess)
MODEL=(model "${PIPELINE_MODEL_PORT:-8102}" digits_cnn)
step "scale preprocess and model to 2; every replica serves"
$COMPOSE up -d --no-recreate --scale preprocess=2 --scale model=2
wait_healthy 6
before=$(replica_counts "${PREPROCESS[@]}")
before_model=$(replica_counts "${MODEL[@]}")
say "replicas before: preprocess $before, model $before_model"
# The router looks the stage names up again every PIPELINE_RESOLVE_INTERVAL_S and finds the new replicas;
# send load until every replica of both has served, at most 60 s.
both_served='import json, sys; b, a = json.loads(sys.argv[1]), json.loads(sys.argv[2]); sys.exit(0 if len(a) == 2 and all(a[k] > b.get(k, 0) for k in a) else 1)'
served=0
for _ in $(seq 6); do
    load 5 4 >/dev/null || die "requests failed while scaling up"
    after=$(replica_counts "${PREPROCESS[@]}")
    after_model=$(replica_counts "${MODEL[@]}")
    if "$PYTHON" -c "$both_served" "$before" "$after" && "$PYTHON" -c "$both_served" "$before_model" "$after_model"; then
        served=1
        break
    fi
done
say "replicas after: preprocess $after, model $after_model"
((served)) || die "the replicas did not all serve within 60s of load (preprocess $before -> $after, model $before_model -> $after_model)"

# --- 6b. Prometheus and the dashboard, during a bench run ---------------------------------------------------
step "observability: Prometheus scrapes every replica; every dashboard query returns data during a bench run"
$COMPOSE --profile observability up -d --no-deps prometheus
bench_image=$(ls "$work"/digits/*.png | head -1)
"$PYTHON" -m pipeline bench --url "$ROUTER" --token "$CLIENT_TOKEN" --model digits --input-file "IMAGE=$bench_image" --concurrency 4 \
    --warmup 1 --duration 20 --no-progress >"$work/bench.txt" 2>&1 &
bench=$!
"$PYTHON" scripts/check-observability.py --prometheus "$PROMETHEUS" \
    --dashboard observability/grafana/dashboards/pipeline.json --timeout 90 \
    --targets router=1 preprocess=2 model=2 postprocess=1 prometheus=1 || { kill "$bench" 2>/dev/null; die "observability check failed"; }
wait "$bench" || { cat "$work/bench.txt"; die "the bench run failed"; }
tail -4 "$work/bench.txt" | sed 's/^/  /'

# --- 7. stop one replica under load ----------------------------------------------------------------------
step "stop one preprocess replica under load; no request may fail"
victim=$(docker ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
    --filter "label=com.docker.compose.service=preprocess" | head -1)
load 20 4 >/tmp/ci-docker-load.json &
loader=$!
sleep 5
say "stopping preprocess container $victim (SIGTERM: it drains, then exits)"
docker stop -t 20 "$victim" >/dev/null
wait "$loader" || { cat /tmp/ci-docker-load.json; die "requests failed while a replica stopped"; }
say "load while stopping a replica: $(cat /tmp/ci-docker-load.json)"
say "preprocess replicas left: $(replica_counts "${PREPROCESS[@]}")"
load 3 2 >/dev/null || die "requests failed after a replica stopped"

# --- 8. kill a model replica under load -------------------------------------------------------------------
# SIGKILL: no draining; the calls in flight to it fail UNAVAILABLE and the router sends them again to the
# other replica. Its in-flight batches are the case gRPC's own retries cannot cover.
step "kill one model replica (SIGKILL) under load; no request may fail"
victim=$(docker ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
    --filter "label=com.docker.compose.service=model" | head -1)
load 10 4 >/tmp/ci-docker-load.json &
loader=$!
sleep 3
say "killing model container $victim"
docker kill "$victim" >/dev/null
wait "$loader" || { cat /tmp/ci-docker-load.json; die "requests failed while a model replica was killed"; }
say "load while killing a model replica: $(cat /tmp/ci-docker-load.json)"

# --- 9. the scaling benchmark's Compose mode ---------------------------------------------------------------
# `up --scale model=1` and `=2` for the embeddings ensemble in a project of its own (no tokens), after this
# one is down, the load generator in a container on the stages' network. Its figures are printed for the
# record, not checked: this machine's speed is not CI's concern.
step "bench.scaling --compose: embeddings with 1 and 2 model replicas"
$COMPOSE --profile observability down -v --remove-orphans >/dev/null 2>&1
compose_up=""
env -u PIPELINE_AUTH_TOKENS -u PIPELINE_STAGE_TOKEN -u COMPOSE_PROJECT_NAME "$PYTHON" -m bench.scaling \
    "$work/scaling" --compose --variants embeddings-model1,embeddings-model2 --duration 10 \
    || die "the scaling benchmark did not run with Compose"

step_end
