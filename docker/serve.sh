#!/bin/bash
# tritonserver with a graceful drain, the container's command: `serve.sh <tritonserver args>`.
# A stopping tritonserver starts no new step of an ensemble, so streams in flight would hang
# until its exit timeout. On SIGTERM / SIGINT this first creates the drain file that
# llm_engine watches (docs/serving.md, Graceful drain): new requests are refused, those in
# flight get drain_timeout_s to finish and are then aborted. Once the engine is empty (its
# vllm:num_requests_* gauges at 0, at most PAGEDLLM_DRAIN_WAIT_S), tritonserver gets the
# signal and exits on its own terms.
set -u
export PAGEDLLM_DRAIN_FILE=${PAGEDLLM_DRAIN_FILE:-/tmp/pagedllm.drain}
metrics=${PAGEDLLM_METRICS_URL:-http://127.0.0.1:8002/metrics}
rm -f "$PAGEDLLM_DRAIN_FILE"

tritonserver "$@" &
server=$!

# shellcheck disable=SC2329 # in_flight and stop run from the trap below
in_flight() {  # requests running or waiting in the engine; 0 when the metrics cannot be read
  curl -fsS --max-time 2 "$metrics" 2>/dev/null |
    awk '/^vllm:num_requests_(running|waiting)\{/ { n += $2 } END { print n + 0 }'
}

# shellcheck disable=SC2329
stop() {
  trap '' TERM INT
  touch "$PAGEDLLM_DRAIN_FILE"
  deadline=$((SECONDS + ${PAGEDLLM_DRAIN_WAIT_S:-30}))
  while [ "$(in_flight)" != 0 ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2
  done
  kill -TERM "$server" 2>/dev/null
}
trap stop TERM INT

wait "$server"  # returns early when a signal arrives: then wait for the server's own exit
status=$?
if kill -0 "$server" 2>/dev/null; then
  wait "$server"
  status=$?
fi
rm -f "$PAGEDLLM_DRAIN_FILE"
exit "$status"
