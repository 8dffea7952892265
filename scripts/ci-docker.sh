#!/usr/bin/env bash
# CI for the containers: install Docker's engine if missing, clone this checkout into a temporary folder
# (what a user gets: the model files are not in git) and, from that clone: build the images offline, start
# the pipeline with Compose and tokens on (the one-shot `model-repository` service writes the example models,
# built in its image, into the repository volume: nothing is built on the host), classify digits through the
# router from the host with Triton's client and with the Go client of examples/go, scale preprocess and
# model to two replicas and show all serve, load a new version of the digits model with RepositoryModelLoad
# on every model replica under load, start Prometheus (the observability profile) and check during a bench
# run that it scrapes every replica and that every query of the Grafana dashboard returns data, stop a
# preprocess replica and kill a model replica (SIGKILL) under load, tear down; then deploy compose.swarm.yaml
# on a single-node Swarm: classify, scale the model service to two and show both serve, a rolling update of
# the model service under load and a rollback; and run the scaling benchmark's Compose mode. No request may
# fail under load; each load run prints its counts. Prints each step's time. About 15 minutes on 2 cores
# when the images are built already, 20 from nothing.
#
#   bash scripts/ci-docker.sh            # as root on a Debian machine (CI here), from anywhere
#
# Env: PYTHON (default .venv/bin/python: has tritonclient[grpc] and scikit-learn; `make install` makes it),
#      COMPOSE_PROJECT_NAME (default pipelineci), PIPELINE_ROUTER_PUBLISHED_PORT (default 18001),
#      PIPELINE_HTTP_PUBLISHED_PORT (default 18000),
#      PIPELINE_PROMETHEUS_PUBLISHED_PORT (default 19090),
#      PIPELINE_STACK_NAME (default pipelineci): the Swarm stack's name,
#      KEEP_UP=1 leaves the pipeline (or the stack) and the clone in place when a step fails.
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
export PIPELINE_ADMIN_TOKENS=${PIPELINE_ADMIN_TOKENS:-$(random_token)}
export CLIENT_TOKEN=${PIPELINE_AUTH_TOKENS%%,*}
PYTHON=${PYTHON:-.venv/bin/python}
# Absolute, for use from the clone; not resolved through the link, which would leave the virtual environment.
[[ "$PYTHON" == */* ]] && PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")
STACK=${PIPELINE_STACK_NAME:-pipelineci}
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
stack_up=""
started_swarm=""
leave_swarm() {  # and the bridge network `swarm init` made, which leaving keeps
    docker swarm leave --force >/dev/null 2>&1 || true
    docker network rm docker_gwbridge >/dev/null 2>&1 || true
    started_swarm=""
}
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
    if [[ -n "$stack_up" && "${KEEP_UP:-0}" != 1 ]]; then
        if ((code != 0)); then
            say "logs of the failed run (last 40 lines per service):"
            docker stack ps --no-trunc "$STACK" || true
            for service in router preprocess model postprocess autoscaler; do
                docker service logs --no-task-ids --tail 40 "${STACK}_$service" 2>&1 || true
            done
        fi
        remove_stack
    fi
    if [[ -n "$started_swarm" && "${KEEP_UP:-0}" != 1 ]]; then
        say "== leaving the single-node swarm this run made"
        leave_swarm
    fi
    cd /
    if [[ "${KEEP_UP:-0}" == 1 && $code != 0 ]]; then say "KEEP_UP=1: the clone stays in $work"; else rm -rf "$work"; fi
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

# --- 1b. a clean clone: what a user gets (git's files only: no model files, no virtual environment) -----
step "a clean clone of this checkout (git clone; the rest runs there)"
git diff --quiet HEAD 2>/dev/null || say "note: uncommitted changes are not in the clone (it checks HEAD)"
git clone --quiet --no-hardlinks "$PWD" "$work/clone"
cd "$work/clone"
say "cloned $(git log -1 --format='%h %s' | cut -c1-80)"

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
step "compose up (the model-repository service writes the example repository first); wait until healthy"
compose_up=1
$COMPOSE up -d
wait_healthy 4
$COMPOSE ps
writer=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
    --filter "label=com.docker.compose.service=model-repository")
[[ $(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$writer") == "exited 0" ]] \
    || die "the model-repository service did not complete"
say "model-repository: $(docker logs "$writer" 2>&1 | tail -1)"

# --- 5. classify through the router from the host -------------------------------------------------------
# Triton's client runs in a process of its own (it cannot share one with pipeline._gen).
classify() {  # ROUTER: wait until it is ready (at most 120 s), see a request without a token refused, then
              # classify 200 digits; fails below 90% accuracy
    "$PYTHON" - "$1" <<'EOF'
import io
import os
import sys
import time

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
deadline = time.monotonic() + 120
while True:
    try:
        if client.is_server_ready():
            break
    except triton.InferenceServerException:
        pass
    assert time.monotonic() < deadline, "router not ready within 120 s"
    time.sleep(1)
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
}
step "classify digits through the router with tritonclient"
classify "$ROUTER"

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
# in_router runs a command in the router's container: Compose's here, the Swarm task's later.
in_router() { $COMPOSE exec -T router "$@"; }
replica_counts() {  # SERVICE PORT MODEL
    in_router python - "$@" <<'EOF'
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

# Closed-loop load from the host for a bounded time: DURATION seconds (or until the file STOP_FILE exists,
# when given), THREADS threads, one image per request; prints a JSON summary and fails if any request failed.
load() {  # DURATION THREADS [STOP_FILE]
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
stop_file = sys.argv[4] if len(sys.argv) > 4 else None
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
    while time.monotonic() < stop and not (stop_file and os.path.exists(stop_file)):
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

# --- 6a. a new model version, loaded under load ------------------------------------------------------------
# Version 2 of digits_cnn is written into the repository volume (a copy of version 1, renamed into place in
# one step) and loaded with RepositoryModelLoad on every model replica, one after the other, while 32
# clients run; Triton's default version policy then serves version 2 alone.
load_version() {  # SERVICE PORT MODEL VERSION: RepositoryModelLoad on every replica; what each then serves
    in_router python - "$@" <<'EOF'
import json
import os
import socket
import sys

import grpc
import numpy as np

from pipeline._gen.inference import grpc_service_pb2 as pb
from pipeline._gen.inference import grpc_service_pb2_grpc as pb_grpc

service, port, model, version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
addresses = sorted({info[4][0] for info in socket.getaddrinfo(service, port, proto=socket.IPPROTO_TCP)})
admin = (("authorization", f"Bearer {os.environ['PIPELINE_ADMIN_TOKENS'].split(',')[0]}"),)
token = (("authorization", f"Bearer {os.environ['PIPELINE_STAGE_TOKEN']}"),)
request = pb.ModelInferRequest(model_name=model)  # no version: the one the router's steps get
request.inputs.add(name="INPUT", datatype="FP32", shape=[1, 1, 8, 8])
request.raw_input_contents.append(np.zeros(64, np.float32).tobytes())
replicas = {}
for address in addresses:
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=model), timeout=60, metadata=admin)
        versions = list(stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=5, metadata=token).versions)
        answered = stub.ModelInfer(request, timeout=10, metadata=token).model_version
        replicas[address] = {"versions": versions, "answered_by": answered}
print(json.dumps(replicas))
sys.exit(0 if all(r == {"versions": [version], "answered_by": version} for r in replicas.values()) else 1)
EOF
}
step "load version 2 of digits_cnn with RepositoryModelLoad on every model replica under 32 clients"
$COMPOSE run --rm --no-deps -T model-repository \
    sh -c 'cp -r /models/digits_cnn/1 /models/digits_cnn/.2 && mv /models/digits_cnn/.2 /models/digits_cnn/2'
load 14 32 >"$work/load.json" &
loader=$!
sleep 4
loaded=$(load_version "${MODEL[@]}" 2) || { kill "$loader" 2>/dev/null; die "version 2 is not what every replica serves: $loaded"; }
wait "$loader" || { cat "$work/load.json"; die "requests failed while version 2 was loaded"; }
say "model replicas after the load: $loaded"
say "load while loading version 2: $(cat "$work/load.json")"

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

# --- 9. the Swarm stack: deploy, scale, a rolling update and a rollback under load ---------------------------
# compose.swarm.yaml on a single-node swarm (made here, left at the end), the same images and tokens. Swarm
# runs no one-shot service before the others: the repository volume is filled first, as its header says.
# Swarm's routing mesh needs the kernel's IPVS; without it the router publishes on this node (mode host).
remove_stack() {
    say "== teardown: docker stack rm $STACK"
    docker stack rm "$STACK" >/dev/null 2>&1 || true
    for _ in $(seq 60); do
        [[ -z $(docker ps -aq --filter "label=com.docker.stack.namespace=$STACK") \
            && -z $(docker network ls -q --filter "label=com.docker.stack.namespace=$STACK") ]] && break
        sleep 1
    done
    docker volume rm "${STACK}_model-repository" "${STACK}_engine-cache" >/dev/null 2>&1 || true
    docker image rm pipeline-model:ci-rollout >/dev/null 2>&1 || true
    stack_up=""
}
# Until every service of the stack runs all its replicas, healthy, on the image it asks for (at most 180 s).
wait_stack() {
    local deadline=$(($(date +%s) + 180)) states
    while true; do
        states=$(docker service ls --filter "label=com.docker.stack.namespace=$STACK" --format '{{.Name}} {{.Replicas}}')
        if awk '{ split($2, r, "/"); if (r[1] != r[2]) bad = 1 } END { exit bad }' <<<"$states" \
            && [[ -z $(docker ps --filter "label=com.docker.stack.namespace=$STACK" --format '{{.Status}}' | grep -v '(healthy)') ]]; then
            return 0
        fi
        (($(date +%s) < deadline)) || { printf '%s\n' "$states" >&2; die "the stack did not converge within 180s"; }
        sleep 2
    done
}
# Load (16 clients) while a command runs, and 3 s beyond; prints the counts, fails if a request failed.
under_load() {  # WHAT COMMAND...
    local what=$1 stop_file="$work/stop-load"
    shift
    rm -f "$stop_file"
    load 600 16 "$stop_file" >"$work/load.json" &
    local loader=$!
    sleep 3
    "$@" || { touch "$stop_file"; wait "$loader" || true; die "$what failed"; }
    sleep 3
    touch "$stop_file"
    wait "$loader" || true
    say "load during the $what: $(cat "$work/load.json")"
    "$PYTHON" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["failed"] != 0)' "$work/load.json" \
        || die "requests failed during the $what"
}
running_images() {
    docker service ps "${STACK}_model" --filter desired-state=running --format '{{.Image}}' | sort | uniq -c | xargs
}

step "swarm: docker stack deploy of compose.swarm.yaml on a single-node swarm; classify digits through the router"
$COMPOSE --profile observability down -v --remove-orphans >/dev/null 2>&1
compose_up=""
if [[ $(docker info -f '{{.Swarm.LocalNodeState}}') != active ]]; then
    docker swarm init --advertise-addr 127.0.0.1 >/dev/null
    started_swarm=1
fi
[[ -d /proc/sys/net/ipv4/vs ]] || export PIPELINE_ROUTER_PUBLISH_MODE=${PIPELINE_ROUTER_PUBLISH_MODE:-host}
stack_up=1
docker run --rm -v "${STACK}_model-repository:/models" "pipeline-model-repository:${PIPELINE_IMAGE_TAG:-latest}"
# The autoscaler waits (0 replicas) until its own step: the steps before scale by hand.
AUTOSCALER_REPLICAS=0 PIPELINE_STACK="$STACK" PIPELINE_AUTOSCALE_INTERVAL=2 PIPELINE_AUTOSCALE_COOLDOWN=20 \
    MODEL_MAX_REPLICAS=2 docker stack deploy --resolve-image never -c compose.swarm.yaml "$STACK" >/dev/null
wait_stack
docker service ls --filter "label=com.docker.stack.namespace=$STACK" --format '  {{.Name}} {{.Replicas}} {{.Image}} {{.Ports}}'
classify "$ROUTER"
router_task=$(docker ps -q --filter "label=com.docker.swarm.service.name=${STACK}_router" | head -1)
in_router() { docker exec -i "$router_task" "$@"; }

step "swarm: docker service scale the model service to 2; both replicas serve"
docker service scale --detach=false "${STACK}_model=2" >/dev/null
wait_stack
before_model=$(replica_counts "${MODEL[@]}")
served=0
for _ in $(seq 6); do
    load 5 4 >/dev/null || die "requests failed while the model service scaled up"
    after_model=$(replica_counts "${MODEL[@]}")
    if "$PYTHON" -c "$both_served" "$before_model" "$after_model"; then served=1; break; fi
done
say "model replicas: $before_model -> $after_model"
((served)) || die "the model replicas did not both serve within 60s of load ($before_model -> $after_model)"

step "swarm: rolling update of the model service under load (a new image tag, start-first)"
docker tag "pipeline-model:${PIPELINE_IMAGE_TAG:-latest}" pipeline-model:ci-rollout
under_load "rolling update" docker service update --detach=false --quiet --no-resolve-image \
    --image pipeline-model:ci-rollout "${STACK}_model"
say "model tasks running: $(running_images)"
[[ $(running_images) == "2 pipeline-model:ci-rollout" ]] || die "the update did not replace both tasks"

step "swarm: rollback of the model service under load"
under_load "rollback" docker service rollback --detach=false --quiet "${STACK}_model"
say "model tasks running: $(running_images)"
[[ $(running_images) == "2 pipeline-model:${PIPELINE_IMAGE_TAG:-latest}" ]] || die "the rollback did not restore both tasks"

step "swarm: the autoscaler service scales the model service up under load and back after its cool-down"
docker service scale --detach=false "${STACK}_model=1" >/dev/null
wait_stack
docker service scale --detach=false "${STACK}_autoscaler=1" >/dev/null
model_replicas() { docker service inspect -f '{{.Spec.Mode.Replicated.Replicas}}' "${STACK}_model"; }
rm -f "$work/stop-load"
load 120 32 "$work/stop-load" >"$work/load.json" &
loader=$!
scaled=""
for _ in $(seq 50); do
    (($(model_replicas) >= 2)) && { scaled=1; break; }
    sleep 2
done
if [[ -n "$scaled" ]]; then sleep 10; fi  # calls on both replicas before the load stops
touch "$work/stop-load"
wait "$loader" || true
say "load while the autoscaler worked: $(cat "$work/load.json")"
docker service logs --no-task-ids --tail 10 "${STACK}_autoscaler" 2>&1 || true
[[ -n "$scaled" ]] || die "the autoscaler did not scale the model service up within 100s of load"
"$PYTHON" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["failed"] != 0)' "$work/load.json" \
    || die "requests failed while the autoscaler scaled the model service"
for _ in $(seq 60); do
    (($(model_replicas) == 1)) && break
    sleep 2
done
(($(model_replicas) == 1)) || die "the autoscaler did not scale the model service back to 1 within 120s of idleness"
say "the autoscaler scaled the model service 1 -> 2 under load and back to 1"

step "swarm: docker stack rm; leave the swarm"
remove_stack
if [[ -n "$started_swarm" ]]; then leave_swarm; fi

# --- 10. the scaling benchmark's Compose mode --------------------------------------------------------------
# `up --scale model=1` and `=2` for the embeddings ensemble in a project of its own (no tokens), the load
# generator in a container on the stages' network. Its figures are printed for the record, not checked:
# this machine's speed is not CI's concern.
step "bench.scaling --compose: embeddings with 1 and 2 model replicas"
env -u PIPELINE_AUTH_TOKENS -u PIPELINE_STAGE_TOKEN -u PIPELINE_ADMIN_TOKENS -u COMPOSE_PROJECT_NAME "$PYTHON" -m bench.scaling \
    "$work/scaling" --compose --variants embeddings-model1,embeddings-model2 --duration 10 \
    || die "the scaling benchmark did not run with Compose"

step_end
