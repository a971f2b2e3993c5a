#!/bin/sh
# Writes the Redis ACL file (one user per tidal role) from the passwords in LEARNER_PASSWORD
# and ACTOR_PASSWORD (the tidal-redis Secret), for the keys of one run: <prefix>:<name>:*, read
# from the run's config (broker.redis.prefix, default tidal; the top-level name). Runs as the Redis
# pod's init container. Only SHA-256 hashes reach the file, so its volume never holds a password.
#   redis-users.sh OUTPUT_FILE RUN_CONFIG
set -eu
out="${1:?usage: redis-users.sh OUTPUT_FILE RUN_CONFIG}"
run="${2:?usage: redis-users.sh OUTPUT_FILE RUN_CONFIG}"

require() {
    if [ "${#2}" -lt 16 ]; then
        echo "redis-users.sh: the $1 password is empty or shorter than 16 characters;" \
             "set $1-password in k8s/base/redis.env (see redis.env.example)" >&2
        exit 1
    fi
}
sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }

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
#   SCAN, SWAPDB, FLUSH*, CONFIG or any other administration. It alone acknowledges prompts and
#   writes dead letters.
# actor: each command only on the stream it needs, one selector per stream kind:
#   prompts   claim and read work (XREADGROUP, XAUTOCLAIM, XCLAIM); never acknowledge it
#   rollouts, heartbeats   append only
#   weights   read announcements only
#   redis-py's CLIENT SETINFO on connect is refused; redis-py ignores that refusal.
umask 077
cat >"$out.tmp" <<EOF2
user default off resetpass resetkeys resetchannels -@all
user learner on #$(sha "$LEARNER_PASSWORD") resetkeys resetchannels -@all +ping +hello +client|setname +multi +exec +discard ~$keys:* +xadd +xgroup|create +xreadgroup +xack +xdel +xpending +xinfo|groups +xtrim +xread +xrange +xrevrange +xclaim +xautoclaim +xlen +del
user actor on #$(sha "$ACTOR_PASSWORD") resetkeys resetchannels -@all +ping +hello +client|setname (%RW~$keys:prompts +xreadgroup +xautoclaim +xclaim +xpending) (%W~$keys:rollouts %W~$keys:heartbeats +xadd) (%R~$keys:weights +xread +xrevrange)
EOF2
mv "$out.tmp" "$out"
echo "redis-users.sh: users learner and actor on keys $keys:*"
