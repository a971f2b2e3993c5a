#!/bin/sh
# Writes the Redis ACL file for the keys of one run: <prefix>:<name>:*, read from the run's config
# (broker.redis.prefix, default tidal; the top-level name). Runs as the Redis pod's init container.
# Only SHA-256 hashes reach the file, so its volume never holds a password.
#   redis-users.sh OUTPUT_FILE RUN_CONFIG
# Users: learner (LEARNER_PASSWORD); one per actor, tidal-actor-0 .. tidal-actor-<NUM_ACTOR_USERS - 1>
# (the StatefulSet's pod names), each with a password of its own derived from ACTOR_PASSWORD; keda,
# read-only, when KEDA_PASSWORD is set. An actor pod learns only its own password:
#   redis-users.sh --actor-password POD_NAME     (prints it; run by the actor pod's init container)
# so one actor's credential can be revoked without stopping the others: REVOKED_ACTORS="tidal-actor-3 ..."
# writes those users switched off (then restart the Redis pod; its AOF keeps the streams).
#
# What Redis ACLs cannot enforce, so the learner checks it itself (broker/redis_transport.py):
# - All actors append to the same rollouts and heartbeats streams: ACL key patterns cannot tie an
#   entry to the user that wrote it, and Redis does not record the writer. The actor id inside a
#   frame, and the consumer name an actor reads prompts under, are claims; the learner takes a
#   rollout only when its prompt is pending at the consumer named in it.
# - XADD's fields, their contents and sizes, and whether it carries MAXLEN: an actor may append
#   entries of any size without trimming. Only maxmemory bounds the total; the learner trims what it
#   has read and treats a full Redis as back-pressure.
# - How often a user writes: no rate limits per user.
set -eu

require() {
    if [ "${#2}" -lt 16 ]; then
        echo "redis-users.sh: the $1 password is empty or shorter than 16 characters;" \
             "set $1-password in k8s/base/redis.env (see redis.env.example)" >&2
        exit 1
    fi
}
sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }
# an actor's password: a hash of the actors' secret nested around its pod name (no length extension)
actor_password() { sha "$ACTOR_PASSWORD:$(sha "$ACTOR_PASSWORD:$1")"; }

if [ "${1:-}" = "--actor-password" ]; then
    require actor "${ACTOR_PASSWORD:-}"
    actor_password "${2:?usage: redis-users.sh --actor-password POD_NAME}"
    exit 0
fi

out="${1:?usage: redis-users.sh OUTPUT_FILE RUN_CONFIG}"
run="${2:?usage: redis-users.sh OUTPUT_FILE RUN_CONFIG}"
num_actors="${NUM_ACTOR_USERS:-64}"
require learner "${LEARNER_PASSWORD:-}"
require actor "${ACTOR_PASSWORD:-}"
name=$(sed -n 's/^name: *"\{0,1\}\([A-Za-z0-9_.-]*\)"\{0,1\} *$/\1/p' "$run" | head -n 1)
prefix=$(sed -n 's/^ *prefix: *"\{0,1\}\([A-Za-z0-9_.-]*\)"\{0,1\} *$/\1/p' "$run" | head -n 1)
if [ -z "$name" ]; then
    echo "redis-users.sh: no top-level 'name:' in $run" >&2
    exit 1
fi
keys="${prefix:-tidal}:$name"

# default: no anonymous access at all.
# learner: only the stream commands tidal's learner sends, only on this run's keys: no KEYS,
#   SCAN, SWAPDB, FLUSH*, CONFIG or any other administration. It alone acknowledges prompts,
#   deletes and trims entries and writes dead letters.
# tidal-actor-N: each command only on the stream it needs, one selector per stream kind:
#   prompts   claim and read work (XREADGROUP, XAUTOCLAIM, XCLAIM); never acknowledge it
#   rollouts, heartbeats   append only
#   weights   read announcements only
#   redis-py's CLIENT SETINFO on connect is refused; redis-py ignores that refusal.
# keda: reads the prompt stream's consumer-group lag, nothing else (never the learner's password).
actor_rules="resetkeys resetchannels -@all +ping +hello +client|setname (%RW~$keys:prompts +xreadgroup +xautoclaim +xclaim +xpending) (%W~$keys:rollouts %W~$keys:heartbeats +xadd) (%R~$keys:weights +xread +xrevrange)"
umask 077
{
    echo "user default off resetpass resetkeys resetchannels -@all"
    echo "user learner on #$(sha "$LEARNER_PASSWORD") resetkeys resetchannels -@all +ping +hello +client|setname +multi +exec +discard ~$keys:* +xadd +xgroup|create +xreadgroup +xack +xdel +xpending +xinfo|groups +xtrim +xread +xrange +xrevrange +xclaim +xautoclaim +xlen +del"
    i=0
    while [ "$i" -lt "$num_actors" ]; do
        state=on
        case " ${REVOKED_ACTORS:-} " in *" tidal-actor-$i "*) state=off ;; esac
        echo "user tidal-actor-$i $state #$(sha "$(actor_password "tidal-actor-$i")") $actor_rules"
        i=$((i + 1))
    done
    if [ -n "${KEDA_PASSWORD:-}" ]; then
        require keda "$KEDA_PASSWORD"
        echo "user keda on #$(sha "$KEDA_PASSWORD") resetkeys resetchannels -@all +ping +hello +client|setname %R~$keys:prompts +xinfo|groups +xlen"
    fi
} >"$out.tmp"
mv "$out.tmp" "$out"
echo "redis-users.sh: users learner, tidal-actor-0..$((num_actors - 1))${KEDA_PASSWORD:+, keda} on keys $keys:*"
