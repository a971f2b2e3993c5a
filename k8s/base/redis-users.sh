#!/bin/sh
# Writes the Redis ACL file (one user per tidal role) from the passwords in LEARNER_PASSWORD
# and ACTOR_PASSWORD (the tidal-redis Secret). Runs as the Redis pod's init container.
# Only SHA-256 hashes reach the file, so the volume it sits on never holds a password.
# The key patterns assume broker.redis.prefix = tidal.
set -eu
out="${1:?usage: redis-users.sh OUTPUT_FILE}"

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

# default: no anonymous access at all.
# learner: owns the streams, so any command on tidal:* keys and channels, but nothing that
#   reconfigures the server or flushes whole databases (FLUSHALL ignores key patterns).
# actor: each command only on the streams it needs, one selector per stream kind:
#   prompts   claim, read, acknowledge work (XREADGROUP, XAUTOCLAIM, XCLAIM read and write it)
#   rollouts, heartbeats, dead   append only
#   weights   read announcements only
#   redis-py's CLIENT SETINFO on connect is refused; redis-py ignores that refusal.
umask 077
cat >"$out.tmp" <<EOF
user default off resetpass resetkeys resetchannels -@all
user learner on #$(sha "$LEARNER_PASSWORD") resetkeys resetchannels ~tidal:* &tidal:* +@all -@admin -flushall -flushdb
user actor on #$(sha "$ACTOR_PASSWORD") resetkeys resetchannels -@all +ping +hello +multi +exec +client|setname (%RW~tidal:*:prompts +xreadgroup +xack +xautoclaim +xclaim +xpending) (%W~tidal:*:rollouts %W~tidal:*:heartbeats %W~tidal:*:dead +xadd) (%R~tidal:*:weights +xread +xrevrange)
EOF
mv "$out.tmp" "$out"
