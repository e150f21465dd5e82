#!/usr/bin/env bash
# loraplex's single-host production layout on this machine, for a trial (docs/DEPLOY.md):
# Redis (the adapter index, the hot-blob cache, the change feed), moto's S3 server standing in
# for any S3 endpoint, one adapter store (loraplex-store) with a shared secret, and two
# inference servers (loraplex-server) sharing it, each with gRPC, OpenAI HTTP and metrics ports.
#
# Usage:
#   scripts/run_stack.sh start [DIR]   start everything; secret, data, logs and PIDs in DIR (default .stack)
#   scripts/run_stack.sh stop [DIR]    stop the processes DIR/pids names, by PID, the servers first
#
# Settings (environment):
#   STACK_BASE_PORT  first port (default 18000): Redis +0, S3 +1, store +2 (metrics +3); server 1:
#                    gRPC +10, HTTP +11, metrics +12; server 2: gRPC +20, HTTP +21, metrics +22
#   STACK_WAIT_S     how long the servers may take to load the model (default 600)
#   PYTHON           the Python with loraplex installed (default .venv/bin/python, else python3)
#   REDIS_SERVER     the redis-server binary (default: redis-server on PATH)
#   LORAPLEX_*       server settings for both servers (LORAPLEX_MODEL, LORAPLEX_DEVICE, ...); the
#                    ports and the store flags set here win over them
# Writes DIR/endpoints.env (shell variables naming every endpoint) and prints the endpoints.
set -Eeuo pipefail  # -E: the ERR trap of `start` also fires inside the functions it calls

ACTION="${1:-}"
DIR="${2:-.stack}"
BASE="${STACK_BASE_PORT:-18000}"
WAIT_S="${STACK_WAIT_S:-600}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
REDIS_SERVER="${REDIS_SERVER:-redis-server}"
BUCKET=loraplex-adapters
REDIS_PORT=$BASE S3_PORT=$((BASE + 1)) STORE_PORT=$((BASE + 2)) STORE_METRICS_PORT=$((BASE + 3))

say() { echo "run_stack: $*" >&2; }

listening() {  # is something listening on 127.0.0.1:$1?
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

alive() {  # is process $1 running (and not a zombie)?
    [ -e "/proc/$1" ] && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null
}

record() {  # record() NAME PID: remember a started process for `stop`
    echo "$1 $2" >> "$DIR/pids"
}

wait_port() {  # wait_port NAME PORT PID SECONDS
    local deadline=$((SECONDS + $4))
    until listening "$2"; do
        alive "$3" || { say "$1 exited while starting; its log:"; tail -n 30 "$DIR/logs/$1.log" >&2; return 1; }
        [ $SECONDS -lt "$deadline" ] || { say "$1 did not listen on port $2 within $4s"; return 1; }
        sleep 0.2
    done
}

serving() {  # does the HTTP port $1 answer /health with 200 (the model is loaded)?
    local status
    status=$( (exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET /health HTTP/1.0\r\n\r\n' >&3 && head -n 1 <&3) \
        2>/dev/null || true)
    [[ "$status" == *" 200 "* ]]
}

wait_serving() {  # wait_serving NAME HTTP_PORT PID SECONDS
    local deadline=$((SECONDS + $4))
    until serving "$2"; do
        alive "$3" || { say "$1 exited while starting; its log:"; tail -n 30 "$DIR/logs/$1.log" >&2; return 1; }
        [ $SECONDS -lt "$deadline" ] || { say "$1 not SERVING within $4s; see $DIR/logs/$1.log"; return 1; }
        sleep 1
    done
}

start_redis() {
    mkdir -p "$DIR/redis"
    "$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$(cd "$DIR/redis" && pwd)" \
        --appendonly yes --save "" > "$DIR/logs/redis.log" 2>&1 &
    record redis $!
    wait_port redis "$REDIS_PORT" $! 30
}

start_s3() {  # moto's S3 server: a local stand-in for AWS S3, MinIO or any S3 endpoint
    "$PYTHON" -P -m moto.server -H 127.0.0.1 -p "$S3_PORT" > "$DIR/logs/s3.log" 2>&1 &
    record s3 $!
    wait_port s3 "$S3_PORT" $! 60
    "$PYTHON" -P -c 'import sys, boto3; boto3.client("s3", endpoint_url=sys.argv[1]).create_bucket(Bucket=sys.argv[2])' \
        "http://127.0.0.1:$S3_PORT" "$BUCKET"
}

start_store() {
    "$PYTHON" -P -m loraplex.adapter_store.main --listen "127.0.0.1:$STORE_PORT" \
        --s3-bucket "$BUCKET" --s3-endpoint-url "http://127.0.0.1:$S3_PORT" --s3-region us-east-1 \
        --redis-url "redis://127.0.0.1:$REDIS_PORT/0" --secret-file "$DIR/store.secret" \
        --metrics-port "$STORE_METRICS_PORT" > "$DIR/logs/store.log" 2>&1 &
    record store $!
    wait_port store "$STORE_PORT" $! 60
}

start_server() {  # start_server N: server N on ports BASE + 10N ...
    local grpc=$((BASE + 10 * $1)) http=$((BASE + 10 * $1 + 1)) metrics=$((BASE + 10 * $1 + 2))
    "$PYTHON" -P -m loraplex.inference_server.main --host 127.0.0.1 --port "$grpc" --http-port "$http" \
        --metrics-port "$metrics" --adapter-store "127.0.0.1:$STORE_PORT" \
        --adapter-store-secret-file "$DIR/store.secret" > "$DIR/logs/server$1.log" 2>&1 &
    record "server$1" $!
}

write_endpoints() {
    {
        echo "REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0"
        echo "S3_ENDPOINT=http://127.0.0.1:$S3_PORT"
        echo "S3_BUCKET=$BUCKET"
        echo "STORE_ADDRESS=127.0.0.1:$STORE_PORT"
        echo "STORE_METRICS=http://127.0.0.1:$STORE_METRICS_PORT/metrics"
        for n in 1 2; do
            echo "SERVER${n}_ADDRESS=127.0.0.1:$((BASE + 10 * n))"
            echo "SERVER${n}_OPENAI=http://127.0.0.1:$((BASE + 10 * n + 1))/v1"
            echo "SERVER${n}_METRICS=http://127.0.0.1:$((BASE + 10 * n + 2))/metrics"
        done
    } > "$DIR/endpoints.env"
}

print_endpoints() {
    pid() { awk -v n="$1" '$1 == n {print $2}' "$DIR/pids"; }
    cat <<EOF
loraplex stack is up (state in $DIR; stop it with: scripts/run_stack.sh stop $DIR)
  redis    redis://127.0.0.1:$REDIS_PORT/0                                  pid $(pid redis)
  s3       http://127.0.0.1:$S3_PORT (moto), bucket $BUCKET                  pid $(pid s3)
  store    127.0.0.1:$STORE_PORT, metrics http://127.0.0.1:$STORE_METRICS_PORT/metrics     pid $(pid store)
  server1  gRPC 127.0.0.1:$((BASE + 10)), OpenAI http://127.0.0.1:$((BASE + 11))/v1, metrics http://127.0.0.1:$((BASE + 12))/metrics   pid $(pid server1)
  server2  gRPC 127.0.0.1:$((BASE + 20)), OpenAI http://127.0.0.1:$((BASE + 21))/v1, metrics http://127.0.0.1:$((BASE + 22))/metrics   pid $(pid server2)
Try:
  loraplex --address 127.0.0.1:$((BASE + 10)) adapters upload acme/pirate ./my-peft-folder
  loraplex --address 127.0.0.1:$((BASE + 20)) generate --adapter acme/pirate "Hi!"
EOF
}

start() {
    if [ -s "$DIR/pids" ]; then
        say "$DIR/pids exists: a stack may be running; run: scripts/run_stack.sh stop $DIR"
        exit 1
    fi
    command -v "$REDIS_SERVER" >/dev/null || { say "no $REDIS_SERVER (apt-get install redis-server)"; exit 1; }
    for port in "$REDIS_PORT" "$S3_PORT" "$STORE_PORT" "$STORE_METRICS_PORT" $((BASE + 10)) $((BASE + 11)) \
            $((BASE + 12)) $((BASE + 20)) $((BASE + 21)) $((BASE + 22)); do
        if listening "$port"; then say "port $port is in use: choose other ports with STACK_BASE_PORT"; exit 1; fi
    done
    mkdir -p "$DIR/logs"
    : > "$DIR/pids"
    trap 'say "start failed; stopping what started"; stop; exit 1' ERR
    # moto accepts any credentials; boto3 needs some to sign its requests. A real endpoint's keys
    # would come from the standard AWS chain, as for loraplex-store in production.
    export AWS_ACCESS_KEY_ID=stack AWS_SECRET_ACCESS_KEY=stack AWS_DEFAULT_REGION=us-east-1
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.token_hex(32))' > "$DIR/store.secret")
    start_redis
    start_s3
    start_store
    start_server 1
    start_server 2
    wait_serving server1 $((BASE + 11)) "$(awk '$1 == "server1" {print $2}' "$DIR/pids")" "$WAIT_S"
    wait_serving server2 $((BASE + 21)) "$(awk '$1 == "server2" {print $2}' "$DIR/pids")" "$WAIT_S"
    trap - ERR
    write_endpoints
    print_endpoints
}

stop() {
    [ -f "$DIR/pids" ] || { say "nothing to stop: no $DIR/pids"; return 0; }
    local name pid deadline
    # newest first: the servers drain (SIGTERM) before the store, the store before Redis and S3
    tac "$DIR/pids" | while read -r name pid; do
        [ -n "$pid" ] && alive "$pid" || continue
        kill -TERM "$pid" 2>/dev/null || continue
        deadline=$((SECONDS + 40))
        while alive "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
        if alive "$pid"; then say "$name ($pid) did not stop within 40s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
        say "stopped $name ($pid)"
    done
    rm -f "$DIR/pids"
}

case "$ACTION" in
    start) start ;;
    stop) stop ;;
    *) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
