"""The Redis ACL users of k8s/ on a real redis-server: each role may send exactly the commands its
transport sends, each actor has a password of its own (another actor's does not open it, and one can
be revoked alone), KEDA reads only the lag, and the server flags and probes of the manifest work."""

import re
import secrets
import shutil
import subprocess
import time

import pytest
import yaml

from conftest import ROOT

K8S = ROOT / "k8s"


def redis_version() -> tuple[int, ...]:
    binary = shutil.which("redis-server")
    if binary is None:
        return ()
    found = re.search(r"v=(\d+)\.(\d+)", subprocess.run([binary, "--version"], capture_output=True, text=True).stdout)
    return tuple(int(x) for x in found.groups()) if found else ()


# the commands broker/redis_transport.py sends, in the forms it sends them, on the keys of run `tiny`
ACTOR_MAY = [
    "XREADGROUP GROUP actors tidal-actor-0 COUNT 1 STREAMS tidal:tiny:prompts >",
    "XAUTOCLAIM tidal:tiny:prompts actors tidal-actor-0 60000 0-0",
    "XCLAIM tidal:tiny:prompts actors tidal-actor-0 0 0-1 JUSTID",
    "XPENDING tidal:tiny:prompts actors - + 10",
    "XADD tidal:tiny:rollouts * m 1",
    "XADD tidal:tiny:heartbeats MAXLEN ~ 1000 * m 1",
    "XREAD COUNT 1 BLOCK 10 STREAMS tidal:tiny:weights $",
    "XREVRANGE tidal:tiny:weights + - COUNT 1",
    "PING",
    "HELLO 3",
    "CLIENT SETNAME tidal-actor-0",
]
ACTOR_MAY_NOT = [
    "XACK tidal:tiny:prompts actors 0-1",  # only the learner acknowledges, once it checked the rollout
    "XADD tidal:tiny:dead MAXLEN 1000 * m 1",  # dead letters are the learner's
    "XADD tidal:tiny:prompts * g 1",
    "XADD tidal:tiny:weights * v 1",
    "XREAD STREAMS tidal:tiny:rollouts 0-0",
    "XREADGROUP GROUP learner l STREAMS tidal:tiny:rollouts >",
    "XGROUP CREATE tidal:tiny:prompts actors $",
    "XDEL tidal:tiny:prompts 0-1",
    "XTRIM tidal:tiny:rollouts MAXLEN 0",
    "DEL tidal:tiny:prompts",
    "XADD other:tiny:rollouts * g 1",
    "XADD tidal:other:rollouts * g 1",
    "GET tidal:tiny:prompts",
    "KEYS *",
    "FLUSHALL",
    "CONFIG GET *",
    "MULTI",
]
LEARNER_MAY = [
    "XGROUP CREATE tidal:tiny:prompts actors $ MKSTREAM",
    "XADD tidal:tiny:prompts * g 1",
    "XREADGROUP GROUP learner l STREAMS tidal:tiny:rollouts >",
    "XADD tidal:tiny:weights * v 1",
    "XINFO GROUPS tidal:tiny:prompts",
    "XAUTOCLAIM tidal:tiny:rollouts learner l 1000 0-0",
    "XTRIM tidal:tiny:prompts MINID 0-1",
    "XREAD COUNT 10 STREAMS tidal:tiny:heartbeats 0-0",
    "XACK tidal:tiny:prompts actors 0-1",
    "XACK tidal:tiny:rollouts learner 0-1",
    "XDEL tidal:tiny:prompts 0-1",  # a prompt it sent again replaces the old entry
    "XPENDING tidal:tiny:prompts actors - + 10",
    "XRANGE tidal:tiny:prompts - + COUNT 10",
    "XADD tidal:tiny:dead MAXLEN 1000 * m 1",
    "DEL tidal:tiny:rollouts",
    "MULTI",
    "EXEC",
    "PING",
]
LEARNER_MAY_NOT = [
    "GET other",
    "XADD other:tiny:prompts * g 1",
    "XADD tidal:other:prompts * g 1",
    "DEL tidal:other:rollouts",
    "FLUSHALL",
    "FLUSHDB",
    "SWAPDB 0 1",
    "KEYS *",
    "SCAN 0",
    "CONFIG SET appendfsync no",
    "SHUTDOWN",
    "ACL SETUSER someone on",
    "DEBUG SLEEP 0",
    "SET tidal:tiny:prompts x",
    "EVAL return 1 0",
]
KEDA_MAY = ["XINFO GROUPS tidal:tiny:prompts", "XLEN tidal:tiny:prompts", "PING"]
KEDA_MAY_NOT = [
    "XADD tidal:tiny:prompts * g 1",
    "XREADGROUP GROUP actors k STREAMS tidal:tiny:prompts >",
    "XRANGE tidal:tiny:prompts - +",
    "XINFO GROUPS tidal:tiny:rollouts",
    "XADD tidal:tiny:rollouts * m 1",
    "XREAD STREAMS tidal:tiny:weights 0-0",
    "DEL tidal:tiny:prompts",
    "KEYS *",
    "CONFIG GET *",
]
NUM_ACTOR_USERS = 3


def client(sock: str, username: str | None = None, password: str | None = None):
    """No retries: a refused login should fail at once, not after redis-py's backoff."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(unix_socket_path=sock, username=username, password=password, retry=Retry(NoBackoff(), 0))


def actor_password(script, secret: str, pod: str) -> str:
    """What the actor pod's init container computes: its own password, from the actors' secret."""
    return subprocess.run(
        ["sh", str(script), "--actor-password", pod],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "ACTOR_PASSWORD": secret},
    ).stdout.strip()


def test_redis_acl_gives_each_role_only_its_commands(tmp_path):
    import redis

    script = K8S / "base" / "redis-users.sh"
    run_config = ROOT / "configs" / "tiny.yaml"  # name: tiny, the default prefix tidal
    short = subprocess.run(
        ["sh", str(script), str(tmp_path / "x.acl"), str(run_config)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "LEARNER_PASSWORD": "short", "ACTOR_PASSWORD": "x" * 20},
    )
    assert short.returncode == 1 and "learner password" in short.stderr
    secret = {"learner": secrets.token_hex(16), "actor": secrets.token_hex(16), "keda": secrets.token_hex(16)}
    acl = tmp_path / "users.acl"
    subprocess.run(
        ["sh", str(script), str(acl), str(run_config)],
        check=True,
        env={
            "PATH": "/usr/bin:/bin",
            "LEARNER_PASSWORD": secret["learner"],
            "ACTOR_PASSWORD": secret["actor"],
            "KEDA_PASSWORD": secret["keda"],
            "NUM_ACTOR_USERS": str(NUM_ACTOR_USERS),
            "REVOKED_ACTORS": "tidal-actor-2",
        },
    )
    pods = [f"tidal-actor-{i}" for i in range(NUM_ACTOR_USERS)]
    passwords = {"learner": secret["learner"], "keda": secret["keda"]} | {
        pod: actor_password(script, secret["actor"], pod) for pod in pods
    }
    revoked = pods.pop()  # tidal-actor-2: listed in REVOKED_ACTORS
    assert len(set(passwords.values())) == len(passwords) and all(len(passwords[pod]) == 64 for pod in pods)
    text = acl.read_text()
    assert not [pw for pw in [*secret.values(), *passwords.values()] if pw in text], "hashes only in the ACL file"
    acl.write_text(text + "user tester on >tester ~* &* +@all\n")  # ACL DRYRUN needs an admin

    # the server flags of the manifest, on a socket in tmp_path instead of the pod's paths
    sts = next(d for d in yaml.safe_load_all((K8S / "base" / "redis.yaml").read_text()) if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    flags = dict(zip(container["args"][::2], container["args"][1::2]))
    assert flags["--appendonly"] == "yes" and flags["--appendfsync"] == "always"
    flags.update(
        {
            "--aclfile": str(acl),
            "--dir": str(tmp_path),
            "--port": "0",
            "--unixsocket": str(tmp_path / "redis.sock"),
            "--unixsocketperm": "700",
        }
    )
    server = subprocess.Popen(
        ["redis-server", *[x for kv in flags.items() for x in kv]], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "redis.sock").exists():
            assert server.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        sock = str(tmp_path / "redis.sock")
        with pytest.raises(redis.exceptions.RedisError):
            client(sock).xadd("tidal:tiny:rollouts", {"g": 1})  # default user is off
        for role, pw in passwords.items():
            if role != revoked:
                assert redis.Redis(unix_socket_path=sock, username=role, password=pw).ping()
        # one actor's password opens no other actor's user, nor the learner's; the actors' secret opens none;
        # a revoked actor is shut out
        beyond = f"tidal-actor-{NUM_ACTOR_USERS}"  # no such user
        refused = [
            (revoked, passwords[revoked]),
            ("tidal-actor-0", passwords["tidal-actor-1"]),
            ("learner", passwords["tidal-actor-0"]),
            ("tidal-actor-0", secret["actor"]),
            (beyond, actor_password(script, secret["actor"], beyond)),
        ]
        for user, pw in refused:
            with pytest.raises(redis.AuthenticationError):
                client(sock, user, pw).ping()
        # the pod's probe, pointed at this server: passes with the password the pod gets, not without
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe == container["livenessProbe"]["exec"]["command"] == container["startupProbe"]["exec"]["command"]
        if shutil.which("redis-cli"):
            here = [probe[0], probe[1], probe[2].replace("redis-cli", f"redis-cli -s {sock}")]
            auth_env = next(e for e in container["env"] if e["name"] == "REDISCLI_AUTH")
            assert auth_env["valueFrom"]["secretKeyRef"]["key"] == "learner-password"
            for password, code in ((passwords["learner"], 0), (passwords["tidal-actor-0"], 1)):
                assert (
                    subprocess.run(
                        here, env={"PATH": "/usr/bin:/bin", "REDISCLI_AUTH": password}, capture_output=True
                    ).returncode
                    == code
                )
        tester = redis.Redis(unix_socket_path=sock, username="tester", password="tester")

        def allowed(user: str, command: str) -> bool:
            return tester.execute_command("ACL", "DRYRUN", user, *command.split()) in (b"OK", "OK")

        table = (
            [(pod, c, True) for pod in pods for c in ACTOR_MAY]
            + [(pod, c, False) for pod in pods for c in ACTOR_MAY_NOT]
            + [("learner", c, True) for c in LEARNER_MAY]
            + [("learner", c, False) for c in LEARNER_MAY_NOT]
            + [("keda", c, True) for c in KEDA_MAY]
            + [("keda", c, False) for c in KEDA_MAY_NOT]
        )
        wrong = [(user, c, want) for user, c, want in table if allowed(user, c) != want]
        assert not wrong, f"(user, command, should be allowed) that Redis decides otherwise: {wrong}"
        # revoking one actor leaves the others working
        tester.execute_command("ACL", "SETUSER", "tidal-actor-1", "off")
        with pytest.raises(redis.AuthenticationError):
            client(sock, "tidal-actor-1", passwords["tidal-actor-1"]).ping()
        assert client(sock, "tidal-actor-0", passwords["tidal-actor-0"]).ping()
    finally:
        server.terminate()
        server.wait(timeout=10)
