"""CURVE keys for the ZeroMQ transport, and the learner's authenticator, which binds each actor's id
to its key: a peer is who its key says, whatever id it claims.

    <keys_dir>/learner.key, learner.key_secret    the learner's key pair; actors need learner.key only
    <keys_dir>/actors/<actor id>.key               the public keys the learner trusts, one per actor id
    <keys_dir>/actors/<actor id>.key_secret        an actor's key pair: only where that actor runs

`tidal keys DIR --actors actor-0,actor-1` makes them; `tidal run` makes a set of its own in the run
folder (`run_keys`); on Kubernetes they come from a Secret. Folders are 0700 and key files 0600:
a secret key readable by another user would let that user be the learner or an actor. A folder
another user made first is refused (ForeignKeys), and the learner trusts only key files owned by its
own user or root: that user could otherwise add a key of its own and be granted work.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import replace
from pathlib import Path

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from tidal.broker.schema import ActorId
from tidal.config import ConfigError, Curve, ZmqConfig, curve_on

log = logging.getLogger(__name__)

LEARNER = "learner"
FOLDER_MODE, FILE_MODE = 0o700, 0o600


class ForeignKeys(ValueError):
    """A keys folder of another user's: whoever owns it can put keys in it."""


def check_actor_id(actor_id: str) -> str:
    """The id, if the wire accepts it as an actor's (letters, digits and ._:@-, 128 at most, no
    leading dot): a key file named after it stays inside the keys folder."""
    try:
        return msgspec.convert(actor_id, ActorId)
    except msgspec.ValidationError as err:
        raise ValueError(
            f"actor id {actor_id!r} is not valid: {err} (letters, digits and ._:@- only, "
            "starting with a letter or digit, 1 to 128 characters)"
        ) from None


def generate(keys_dir: str | Path, actor_ids: list[str]) -> Path:
    """The learner's key pair and one per actor (existing ones are kept, their modes tightened)."""
    keys_dir = Path(keys_dir)
    for actor_id in actor_ids:  # every id checked before anything is written
        check_actor_id(actor_id)
    _private_folder(keys_dir)
    _private_folder(keys_dir / "actors")
    if not (keys_dir / f"{LEARNER}.key_secret").exists():
        zmq.auth.create_certificates(keys_dir, LEARNER)
    for actor_id in actor_ids:
        if not (keys_dir / "actors" / f"{actor_id}.key_secret").exists():
            zmq.auth.create_certificates(keys_dir / "actors", actor_id)
    for path in (*keys_dir.glob("*.key*"), *(keys_dir / "actors").glob("*.key*")):
        _tighten(path, FILE_MODE)  # written under the process umask; unreadable to others from here on
    return keys_dir


def run_keys(run_dir: str | Path, actor_ids: list[str]) -> Path:
    """This run's own keys, in <run_dir>/keys: `tidal run` authenticates every peer of every port it
    opens, loopback included, without asking for a keys folder."""
    return generate(Path(run_dir) / "keys", actor_ids)


def own_keys(z: ZmqConfig, run_dir: str, role: str, actor_ids: list[str]) -> ZmqConfig:
    """A role started on its own on loopback with no keys named authenticates its peers all the same: the
    learner makes the run's own keys in <run_dir>/keys, as `tidal run` does (every id of `actor_ids`), and
    an actor takes its own from there (`actor_ids`: its id). Left as they are: keys named, a host beyond
    loopback (CURVE is on already), and curve=off, asked for."""
    if z.curve is not Curve.auto or curve_on(z):
        return z
    keys = Path(run_dir) / "keys" if run_dir else None
    if role == "learner":
        return replace(z, curve=Curve.on, keys_dir=str(run_keys(run_dir, actor_ids).resolve()))
    needed = [f"{LEARNER}.key", *(f"actors/{a}.key_secret" for a in actor_ids)]
    absent = next((name for name in needed if keys is None or not (keys / name).is_file()), None)
    if absent is not None:
        where = f"{keys} holds no {absent}" if keys is not None else "run_dir is empty too"
        raise ConfigError(
            f"config key 'broker.zmq.keys_dir' = '': {where}. An actor started on its own authenticates with "
            "its run's keys: set run_dir to the learner's run folder (the learner makes the keys in its "
            "keys/), or name broker.zmq.keys_dir, or set broker.zmq.curve=off to trust anyone who reaches "
            "the learner's ports"
        )
    return replace(z, curve=Curve.on, keys_dir=str(keys.resolve()))


def _private_folder(path: Path) -> None:
    # made 0700 (mkdir's mode is cut by the umask, and an existing folder keeps its own): the key files
    # are written before their chmod, so nobody else may look inside in between
    path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
    _check_owner(path)
    _tighten(path, FOLDER_MODE)


def _check_owner(path: Path, root_too: bool = False) -> None:
    """`path` (a link followed) belongs to this process's user, or to root where `root_too` (a Secret's
    mount, read-only keys an administrator put there)."""
    owner, me = path.stat().st_uid, os.geteuid()
    if owner != me and not (root_too and owner == 0):
        raise ForeignKeys(
            f"{path} belongs to uid {owner}, not to this process's user (uid {me}): whoever made it "
            "can add keys the learner would trust; remove it or choose another folder"
        )


def _tighten(path: Path, mode: int) -> None:
    """Nobody but the owner may read `path`. Left alone when it is already so (a read-only mount of keys,
    a folder of another user's that this process may only read); a warning when it cannot be made so."""
    if not stat.S_IMODE(path.stat().st_mode) & 0o077:
        return
    try:
        os.chmod(path, mode)
    except OSError as err:
        log.warning(
            "%s is readable by other users and cannot be made private (%s): anyone who reads a "
            "secret key there can act as the learner or that actor",
            path,
            err,
        )


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"CURVE key {path} is missing (make keys with `tidal keys DIR --actors ...`)")
    return zmq.auth.load_certificate(str(path))


def require_keys(keys_dir: str, host: str) -> None:
    """CURVE is on: a role started on its own needs the keys folder named (`tidal run` names its own)."""
    if not keys_dir:
        raise ConfigError(
            f"broker.zmq.keys_dir is empty but CURVE is on (broker.zmq.curve, host {host}): name "
            "the keys folder (make one with `tidal keys DIR --actors actor-0,actor-1`)"
        )


def secure_server(sock: zmq.Socket, keys_dir: str) -> None:
    public, secret = _load(Path(keys_dir) / f"{LEARNER}.key_secret")
    sock.curve_publickey, sock.curve_secretkey, sock.curve_server = public, secret, True


def secure_client(sock: zmq.Socket, keys_dir: str, actor_id: str) -> None:
    public, secret = _load(Path(keys_dir) / "actors" / f"{check_actor_id(actor_id)}.key_secret")
    server, _ = _load(Path(keys_dir) / f"{LEARNER}.key")
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server


class ActorKeys(ThreadAuthenticator):
    """ZAP for the learner's context: only the actors' public keys in <keys_dir>/actors get in, and
    each connection's User-Id is the actor id its key belongs to. A key the learner does not know
    makes it read the folder again if the folder changed since, so an actor whose key was added
    with `tidal keys` while the run goes on can join without a restart."""

    def __init__(self, context: zmq.Context, keys_dir: str):
        super().__init__(context)
        self.folder = Path(keys_dir) / "actors"
        self.actor_of: dict[bytes, str] = {}
        self.read_at: float | None = None
        self.skipped: set[str] = set()  # key files of another user's, each said once
        for folder in (Path(keys_dir), self.folder):
            if folder.exists():
                _check_owner(folder, root_too=True)
        self._read()
        if not self.actor_of:
            raise FileNotFoundError(f"no actor keys in {self.folder} (make them with `tidal keys DIR --actors ...`)")

    def begin(self) -> ActorKeys:
        self.start()
        self.configure_curve_callback(domain="*", credentials_provider=self)
        return self

    def callback(self, domain: str, client_key: bytes) -> bool:
        """Whether a connecting key (z85) is an actor's (pyzmq's credentials-provider hook)."""
        if client_key not in self.actor_of:
            self._read()
        return client_key in self.actor_of

    def curve_user_id(self, client_public_key: bytes) -> str:
        from zmq.utils import z85

        return self.actor_of.get(z85.encode(client_public_key), "")

    def _read(self) -> None:
        # a stranger's attempts cost one stat each, not a read of the folder
        try:
            changed = self.folder.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if changed == self.read_at:
            return
        try:
            self.actor_of = {zmq.auth.load_certificate(str(p))[0]: p.stem for p in self._trusted()}
        except (OSError, ValueError):  # a key file being written as we read: the next attempt reads again
            return
        self.read_at = changed

    def _trusted(self) -> list[Path]:
        """The folder's public keys that this user or root wrote."""
        me, kept = os.geteuid(), []
        for path in sorted(self.folder.glob("*.key")):
            owner = path.stat().st_uid
            if owner in (me, 0):
                kept.append(path)
            elif path.name not in self.skipped:
                self.skipped.add(path.name)
                log.warning(
                    "actor key %s belongs to uid %d, not to this user (uid %d) or root: not trusted", path, owner, me
                )
        return kept
