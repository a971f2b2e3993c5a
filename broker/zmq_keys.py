"""CURVE keys for the ZeroMQ transport, and the learner's authenticator, which binds each actor's id
to its key: a peer is who its key says, whatever id it claims.

    <keys_dir>/learner.key, learner.key_secret    the learner's key pair; actors need learner.key only
    <keys_dir>/actors/<actor id>.key               the public keys the learner trusts, one per actor id
    <keys_dir>/actors/<actor id>.key_secret        an actor's key pair: only where that actor runs

`tidal keys DIR --actors actor-0,actor-1` makes them; on Kubernetes they come from a Secret.
"""
from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

LEARNER = "learner"


def generate(keys_dir: str | Path, actor_ids: list[str]) -> Path:
    """The learner's key pair and one per actor (existing ones are kept)."""
    keys_dir = Path(keys_dir)
    (keys_dir / "actors").mkdir(parents=True, exist_ok=True)
    if not (keys_dir / f"{LEARNER}.key_secret").exists():
        zmq.auth.create_certificates(keys_dir, LEARNER)
    for actor_id in actor_ids:
        if not (keys_dir / "actors" / f"{actor_id}.key_secret").exists():
            zmq.auth.create_certificates(keys_dir / "actors", actor_id)
    return keys_dir


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"CURVE key {path} is missing (make keys with `tidal keys DIR --actors ...`)")
    return zmq.auth.load_certificate(str(path))


def secure_server(sock: zmq.Socket, keys_dir: str) -> None:
    public, secret = _load(Path(keys_dir) / f"{LEARNER}.key_secret")
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True


def secure_client(sock: zmq.Socket, keys_dir: str, actor_id: str) -> None:
    public, secret = _load(Path(keys_dir) / "actors" / f"{actor_id}.key_secret")
    server, _ = _load(Path(keys_dir) / f"{LEARNER}.key")
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server


class ActorKeys(ThreadAuthenticator):
    """ZAP for the learner's context: only the actors' public keys in <keys_dir>/actors get in, and
    each connection's User-Id is the actor id its key belongs to."""

    def __init__(self, context: zmq.Context, keys_dir: str):
        super().__init__(context)
        folder = Path(keys_dir) / "actors"
        self.actor_of = {zmq.auth.load_certificate(str(p))[0]: p.stem for p in sorted(folder.glob("*.key"))}
        if not self.actor_of:
            raise FileNotFoundError(f"no actor keys in {folder} (make them with `tidal keys DIR --actors ...`)")
        self.folder = folder

    def begin(self) -> ActorKeys:
        self.start()
        self.configure_curve(domain="*", location=str(self.folder))
        return self

    def curve_user_id(self, client_public_key: bytes) -> str:
        from zmq.utils import z85

        return self.actor_of.get(z85.encode(client_public_key), "")
