#!/usr/bin/env bash
# make compose-test: build the images, bring docker-compose.yml up and prove the stack end to end through its
# containers (tests/deploy/test_compose_stack.py), then take it down with its volumes. Prints a summary.
#
# On a machine without the public image registries (this project's CI): installs docker.io, docker-compose and
# debootstrap when missing, starts dockerd when none answers (and stops only that one), makes the Debian base image
# once with debootstrap (cached as kvmesh-base:bookworm), stages the host's CA bundle and CPU torch wheel in
# docker/local/ for pip inside the build. KVMESH_BASE_IMAGE=python:3.11-slim (with KVMESH_REDIS_BASE_IMAGE=
# redis:7.2-bookworm and KVMESH_TORCH_INDEX_URL unset) builds from the public images instead.
# KVMESH_COMPOSE_KEEP=1 leaves a failed stack up for inspection (and then dockerd too, if this run started it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
PROJECT=${KVMESH_COMPOSE_PROJECT:-kvmesh-compose-test}
BASE_TAG=kvmesh-base:bookworm
export KVMESH_BASE_IMAGE=${KVMESH_BASE_IMAGE:-$BASE_TAG}
export KVMESH_REDIS_BASE_IMAGE=${KVMESH_REDIS_BASE_IMAGE:-$KVMESH_BASE_IMAGE}
# The small random-weight model (2 layers): 2 KiB of KV per token, 64 KiB per 32-token block.
export KVMESH_MODEL=tiny KVMESH_BLOCK_BYTES=65536
WORK=$(mktemp -d /tmp/kvmesh-compose-test.XXXXXX)
DOCKERD_PID=""
STARTED=$(date +%s)
say() { printf 'compose-test: %s\n' "$*" >&2; }
compose() { docker-compose -p "$PROJECT" "$@"; }

cleanup() {
  local rc=$?
  if [ -n "${UP:-}" ]; then
    if [ "$rc" != 0 ]; then
      compose ps >&2 || true
      compose logs --no-color --tail=60 > "$WORK/compose.log" 2>&1 || true
      say "failed; last container logs in $WORK/compose.log"
    fi
    if [ "$rc" != 0 ] && [ -n "${KVMESH_COMPOSE_KEEP:-}" ]; then
      say "KVMESH_COMPOSE_KEEP: the stack stays up; docker-compose -p $PROJECT down -v removes it"
    else
      compose down -v --remove-orphans >/dev/null 2>&1 || say "docker-compose down failed"
    fi
  fi
  rm -f docker/local/ca-bundle.crt docker/local/torch-*.whl
  if [ -n "$DOCKERD_PID" ] && ! { [ "$rc" != 0 ] && [ -n "${KVMESH_COMPOSE_KEEP:-}" ]; }; then
    say "stopping the dockerd this run started (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  fi
  exit "$rc"
}
trap cleanup EXIT

# 1. Tools.
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || [ "$KVMESH_BASE_IMAGE" != "$BASE_TAG" ] || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. A Docker engine.
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: $WORK/dockerd.log)"
  dockerd >"$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start"; tail -20 "$WORK/dockerd.log" >&2; exit 1; }
fi

# 3. The base image, once.
base_s=0
if [ "$KVMESH_BASE_IMAGE" = "$BASE_TAG" ] && ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  say "making $BASE_TAG with debootstrap (~1 min)"
  t0=$(date +%s)
  nice -n 10 debootstrap --variant=minbase bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
  tar -C "$WORK/rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
  rm -rf "$WORK/rootfs"
  base_s=$(( $(date +%s) - t0 ))
fi

# 4. What pip inside the build needs from this host: its CA bundle, and the CPU torch wheel it installs from disk.
pip_setting() { "$PY" -m pip config get "global.$1" 2>/dev/null || true; }
cert=${PIP_CERT:-$(pip_setting cert)}
if [ -n "$cert" ] && [ -f "$cert" ]; then cp "$cert" docker/local/ca-bundle.crt; fi
if [ -z "${KVMESH_TORCH_INDEX_URL+set}" ]; then
  for dir in ${PIP_FIND_LINKS:-} $(pip_setting find-links); do
    wheel=$(ls "$dir"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
    if [ -n "$wheel" ]; then
      ln -f "$wheel" docker/local/ 2>/dev/null || cp "$wheel" docker/local/
      export KVMESH_TORCH_INDEX_URL=""  # build from docker/local/ alone
      break
    fi
  done
fi

# 5. Images (layers cached by Docker: a second run rebuilds only what changed).
say "building kvmesh-redis:dev, kvmesh:dev, kvmesh-engine:dev from $KVMESH_BASE_IMAGE"
t0=$(date +%s)
nice -n 10 docker-compose -p "$PROJECT" build redis control-plane model-init >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log" >&2; exit 1; }
build_s=$(( $(date +%s) - t0 ))
rm -f docker/local/ca-bundle.crt docker/local/torch-*.whl

# 6. Up, on free loopback ports, and wait for every health check (one-shot services: exited with 0).
wait_healthy() {
  local deadline=$(( $(date +%s) + $1 )) pending failed name status health code restarts
  while :; do
    pending="" failed=""
    for id in $(compose ps -q); do
      read -r name status health code restarts < <(docker inspect -f \
        '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.State.ExitCode}} {{.RestartCount}}' "$id")
      case "$status/$health" in
        exited/*) [ "$code" = 0 ] || failed+=" $name(exit $code)" ;;
        running/healthy | running/none) ;;
        *) pending+=" $name($status/$health)" ;;
      esac
      [ "$restarts" = 0 ] || failed+=" $name(restarted $restarts times)"
    done
    [ -z "$failed" ] || { say "failed:$failed"; return 1; }
    [ -n "$pending" ] || return 0
    [ "$(date +%s)" -lt "$deadline" ] || { say "not healthy within $1 s:$pending"; return 1; }
    sleep 3
  done
}
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export KVMESH_CP_PORT=127.0.0.1:$(free_port) KVMESH_ENGINE1_PORT=127.0.0.1:$(free_port)
export KVMESH_ENGINE2_PORT=127.0.0.1:$(free_port)
say "docker-compose up -d (project $PROJECT)"
compose down -v --remove-orphans >/dev/null 2>&1 || true
UP=1
t0=$(date +%s)
compose up -d --no-build >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log" >&2; exit 1; }
wait_healthy 600
start_s=$(( $(date +%s) - t0 ))

# 7. The end-to-end checks, through the containers.
say "running tests/deploy/test_compose_stack.py"
t0=$(date +%s)
KVMESH_COMPOSE_PROJECT=$PROJECT KVMESH_COMPOSE_SUMMARY=$WORK/summary.json \
  "$PY" -m pytest -q -ra -p no:cacheprovider tests/deploy/test_compose_stack.py
test_s=$(( $(date +%s) - t0 ))

# 8. Down, volumes included.
t0=$(date +%s)
compose down -v --remove-orphans >/dev/null 2>&1
UP=""
down_s=$(( $(date +%s) - t0 ))
"$PY" - "$WORK/summary.json" "$base_s" "$build_s" "$start_s" "$test_s" "$down_s" "$(( $(date +%s) - STARTED ))" <<'EOF'
import json, sys
found = json.load(open(sys.argv[1]))
names = ("base_image_s", "build_s", "start_s", "test_s", "down_s", "total_s")
summary = {**dict(zip(names, map(int, sys.argv[2:]))), **found}
print("compose-test summary: " + json.dumps(summary))
EOF
