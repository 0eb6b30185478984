#!/usr/bin/env bash
# A Docker engine for `make compose-test`: install what is missing, start dockerd if nothing answers, wait for it.
#
#   docker/engine.sh start   # exit 0: `docker info` answers; exit 3: this machine cannot run an engine (not root or
#                            # no apt-get: one loud line, the caller skips); any other failure: exit 1
#   docker/engine.sh stop    # stop the dockerd that `start` started (a daemon someone else runs is left alone)
#
# Debian packages (docker.io = engine 20.10, containerd, runc) are installed only as root with apt-get; elsewhere an
# engine must already run. dockerd is started under `nice -n 19` so that image builds and the containers (children
# of its containerd) never compete with foreground work on a small machine.
set -euo pipefail

STATE_DIR=/run/ragserve-docker          # marks a dockerd this script started (pid + log)
PIDFILE="$STATE_DIR/dockerd.pid"
LOG="$STATE_DIR/dockerd.log"
WAIT_S=${RAGSERVE_DOCKERD_WAIT_S:-90}

cannot() {
  echo "!!!!!!!! compose-test SKIPPED: this machine cannot run a Docker engine: $* (see README, Deployment) !!!!!!!!"
  exit 3
}

fail() {
  echo "engine: $*" >&2
  exit 1
}

engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

install_missing() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v containerd >/dev/null || missing+=(containerd)
  command -v runc >/dev/null || missing+=(runc)
  command -v docker >/dev/null || missing+=(docker.io)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || cannot "not root, and ${missing[*]} not installed"
  command -v apt-get >/dev/null || cannot "no apt-get to install ${missing[*]}"
  echo "engine: apt-get install ${missing[*]}"
  # policy-rc.d is not touched: without an init system the package's service start is skipped; we start dockerd.
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
      || fail "apt-get install ${missing[*]} failed"
  fi
}

start() {
  if engine_answers; then
    echo "engine: a Docker engine is running ($(docker version --format 'server {{.Server.Version}}' 2>/dev/null))"
    return 0
  fi
  install_missing
  [ "$(id -u)" = 0 ] || cannot "no engine answers and dockerd needs root"
  mkdir -p "$STATE_DIR"
  echo "engine: starting dockerd (nice -n 19, log $LOG)"
  # setsid: the daemon outlives this script's process group (make, CI) until `stop`.
  setsid nice -n 19 dockerd >"$LOG" 2>&1 < /dev/null &
  echo $! >"$PIDFILE"
  local t=0
  until engine_answers; do
    if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      tail -n 20 "$LOG" >&2 || true
      rm -f "$PIDFILE"
      fail "dockerd exited at start (log above)"
    fi
    t=$((t + 1))
    [ "$t" -le "$WAIT_S" ] || { tail -n 20 "$LOG" >&2; fail "dockerd did not answer within ${WAIT_S} s"; }
    sleep 1
  done
  echo "engine: dockerd $(docker version --format '{{.Server.Version}}') ready after ${t} s"
}

stop() {
  [ -f "$PIDFILE" ] || { echo "engine: no dockerd started by this script"; return 0; }
  local pid
  pid=$(cat "$PIDFILE")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    # dockerd stops its containers (10 s each by default) and its containerd; bounded wait.
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && echo "engine: dockerd $pid still running after 60 s" >&2
  fi
  rm -f "$PIDFILE"
  echo "engine: dockerd stopped"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
