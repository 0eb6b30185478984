#!/usr/bin/env bash
# Base images for the project's Dockerfiles and docker-compose.yml: pulled from the registry when it answers,
# otherwise built locally as stand-ins (no image registry is reachable on our CI machines):
#
#   debian:bookworm-slim       debootstrap --variant=minbase bookworm, slimmed like the official image, docker import
#   python:3.11-slim-bookworm  docker/standin/python.Dockerfile on it (python3.11 + venv + pip + the build CA bundle)
#   redis:7.0-bookworm         docker/standin/redis.Dockerfile on it (Debian's redis-server 7.0)
#
# A stand-in carries the label ragserve.standin=<hash of its recipe> (this script, its Dockerfile, the CA bundle,
# its parent's hash) and is saved to $RAGSERVE_HOME/docker-standin/<name>-<hash>.tar: the next run finds it in the
# engine (seconds) or loads the saved copy (a fresh engine, ~20 s) instead of building again (~3 min).
# A real image already in the engine (no label) is always used as it is.
#
#   docker/base_images.sh python:3.11-slim-bookworm redis:7.0-bookworm
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CACHE="${RAGSERVE_HOME:-$HOME/.cache/ragserve}/docker-standin"
CA_BUNDLE=${RAGSERVE_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
MIRROR=${RAGSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PULL_TIMEOUT_S=${RAGSERVE_PULL_TIMEOUT_S:-120}

TMPDIRS=()
trap 'rm -rf "${TMPDIRS[@]}"' EXIT

log() { echo "base-images: $*"; }

sha() { sha256sum | cut -c1-16; }

label_of() { docker image inspect --format '{{ index .Config.Labels "ragserve.standin" }}' "$1" 2>/dev/null; }

recipe_hash() {  # recipe_hash NAME [PARENT_HASH]
  local name=$1 parent=${2:-}
  {
    cat "$HERE/base_images.sh"
    case "$name" in
      python:*) cat "$HERE/standin/python.Dockerfile" "$CA_BUNDLE" ;;
      redis:*) cat "$HERE/standin/redis.Dockerfile" ;;
    esac
    echo "$name $parent $MIRROR"
  } | sha
}

# ensure NAME: present (real or current stand-in), else pulled, else loaded from the cache, else built.
ensure() {
  local name=$1 parent_hash="" hash have
  case "$name" in
    python:* | redis:*) ;;
    debian:bookworm-slim) ;;
    *) echo "base-images: no stand-in recipe for $name" >&2; return 1 ;;
  esac
  have=$(docker image inspect --format '{{.Id}}' "$name" 2>/dev/null || true)
  if [ -n "$have" ] && [ -z "$(label_of "$name")" ]; then
    log "$name: present (registry image)"
    return 0
  fi
  if [ "$name" != debian:bookworm-slim ]; then
    # The stand-in's hash depends on its parent's recipe; computing it does not need the parent built yet.
    parent_hash=$(recipe_hash debian:bookworm-slim)
  fi
  hash=$(recipe_hash "$name" "$parent_hash")
  if [ -n "$have" ] && [ "$(label_of "$name")" = "$hash" ]; then
    log "$name: present (stand-in $hash)"
    return 0
  fi
  local err
  if err=$(timeout "$PULL_TIMEOUT_S" docker pull -q "$name" 2>&1); then
    log "$name: pulled from the registry"
    return 0
  fi
  log "$name: pull failed ($(echo "$err" | tail -n 1 | cut -c1-160)); using a local stand-in"
  local tar="$CACHE/${name//[:\/]/_}-$hash.tar"
  if [ -f "$tar" ] && docker load -q -i "$tar" >/dev/null && [ "$(label_of "$name")" = "$hash" ]; then
    log "$name: loaded stand-in $hash from $tar"
    return 0
  fi
  local t0=$SECONDS
  case "$name" in
    debian:*) build_debian "$hash" ;;
    python:*) ensure debian:bookworm-slim; build_from_dockerfile "$name" "$hash" python.Dockerfile ;;
    redis:*) ensure debian:bookworm-slim; build_from_dockerfile "$name" "$hash" redis.Dockerfile ;;
  esac
  docker image prune -f --filter label=ragserve.standin >/dev/null  # the previous recipe's image, now untagged
  mkdir -p "$CACHE"
  rm -f "$CACHE/${name//[:\/]/_}-"*.tar  # older recipes of this image
  docker save -o "$tar.part" "$name" && mv "$tar.part" "$tar"
  log "$name: built stand-in $hash in $((SECONDS - t0)) s, saved to $tar ($(du -h "$tar" | cut -f1))"
}

build_debian() {
  local hash=$1 root
  if ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "base-images: debootstrap missing" >&2; return 1; }
    log "apt-get install debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
  fi
  root=$(mktemp -d /var/tmp/ragserve-bookworm.XXXXXX)
  TMPDIRS+=("$root")
  log "debian:bookworm-slim: debootstrap --variant=minbase bookworm (~75 s)"
  nice -n 19 debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; return 1; }
  rm -f "$root.log"
  # Slim like the official image: no docs, man pages or translations now or in later apt installs.
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
  # ... and, like it, apt keeps no downloaded .deb files or package caches in image layers.
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  find "$root/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
  rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/cache/apt/*.bin \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root"/tmp/*
  find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} + 2>/dev/null || true
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  : >"$root/etc/machine-id"
  tar --numeric-owner -C "$root" -c . | docker import \
    --change "LABEL ragserve.standin=$hash" --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - debian:bookworm-slim >/dev/null
}

build_from_dockerfile() {
  local name=$1 hash=$2 dockerfile=$3 ctx
  ctx=$(mktemp -d)
  TMPDIRS+=("$ctx")
  cp "$HERE/standin/$dockerfile" "$ctx/Dockerfile"
  [ "$dockerfile" = python.Dockerfile ] && cp "$CA_BUNDLE" "$ctx/build-ca.crt"
  log "$name: docker build (stand-in)"
  DOCKER_BUILDKIT=0 docker build -q --build-arg STANDIN_HASH="$hash" -t "$name" "$ctx" >/dev/null
}

[ $# -gt 0 ] || { echo "usage: $0 IMAGE..." >&2; exit 2; }
for image in "$@"; do ensure "$image"; done
