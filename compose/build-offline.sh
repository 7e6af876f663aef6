#!/usr/bin/env bash
# Build tokenbus' images where no package index or image registry can be reached.
#
# On a machine with access (the same CPU architecture and Python 3.11 as the image):
#   compose/build-offline.sh fetch              # wheels of tokenbus and every dependency, and
#                                               # the base images, into compose/offline/
# Carry compose/offline/ (and this checkout) to the offline host, then:
#   compose/build-offline.sh build              # tokenbus:latest from those files only
#   compose/build-offline.sh build --vllm       # tokenbus-vllm:latest as well
# With a package mirror on the site instead (devpi, Artifactory, Nexus, a PEP 503 folder):
#   compose/build-offline.sh build --index-url https://pypi.mirror.local/simple
# Then `docker compose -f compose/docker-compose.yml up -d` uses the images built here (it
# builds only images that are missing).
set -euo pipefail
cd "$(dirname "$0")/.."
OFF=compose/offline
PY=${PYTHON:-python3}

usage() { sed -n '2,14p' "$0"; exit 2; }

fetch() {
  mkdir -p "$OFF/wheels"
  # tokenbus and every dependency as wheels for this machine (x86_64 Linux, CPython 3.11, as
  # tokenbus:latest; a dependency published only as source is built into a wheel here), then
  # the binary wheels for CPython 3.12 as well (vLLM's official image).
  "$PY" -m pip wheel -q --no-deps -w "$OFF/wheels" .
  local whl
  whl=$(ls -t "$OFF"/wheels/tokenbus-*.whl | head -1)
  # At the versions the images install (constraints.txt, `make lock`).
  "$PY" -m pip wheel -q -c constraints.txt -w "$OFF/wheels" "$whl" "setuptools>=68" wheel
  "$PY" -m pip download -q -c constraints.txt --only-binary=:all: --python-version 3.12 \
    --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform linux_x86_64 --platform any \
    --find-links "$OFF/wheels" -d "$OFF/wheels" "$whl"
  docker save -o "$OFF/base-images.tar" python:3.11-slim nats:2.15.1-alpine
  echo "fetched into $OFF: $(ls "$OFF/wheels" | wc -l) wheels and the base images"
}

build() {
  local index="" vllm=0
  while [[ $# -gt 0 ]]; do
    case $1 in
      --index-url) index=$2; shift 2 ;;
      --vllm) vllm=1; shift ;;
      *) usage ;;
    esac
  done
  if [[ -f "$OFF/base-images.tar" ]]; then docker load -q -i "$OFF/base-images.tar"; fi
  local args=()
  server=""
  if [[ -n $index ]]; then
    args=(--build-arg "PIP_INDEX_URL=$index")
  else
    [[ -d "$OFF/wheels" ]] || { echo "no $OFF/wheels: run '$0 fetch' where the index is reachable, or give --index-url"; exit 1; }
    # pip in the build reads the wheels over HTTP from this host (a plain directory listing
    # is what --find-links takes), and never asks an index (PIP_NO_INDEX).
    local port
    port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$OFF/wheels" >/dev/null 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null' EXIT
    for _ in $(seq 1 50); do
      "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
      sleep 0.1
    done
    args=(--build-arg PIP_NO_INDEX=1 --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/")
  fi
  docker build --network host "${args[@]}" -t tokenbus:latest -f Dockerfile .
  if [[ $vllm == 1 ]]; then
    docker build --network host "${args[@]}" -t tokenbus-vllm:latest -f Dockerfile.vllm .
  fi
  echo "built tokenbus:latest$([[ $vllm == 1 ]] && echo ' and tokenbus-vllm:latest')"
}

case ${1:-} in
  fetch) shift; fetch "$@" ;;
  build) shift; build "$@" ;;
  *) usage ;;
esac
