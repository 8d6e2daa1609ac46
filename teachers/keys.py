"""`opd keys generate`: CURVE key pairs for teacher servers and their clients.

    opd keys generate --out keys --name server     # keys/server.key, keys/server.key_secret
    opd keys generate --out keys/clients --name trainer1

The server takes its `.key_secret` (--curve-secret-key) and an allow-list of client public
keys (--curve-allow FILE or a directory of `.key` files); a client takes its own
`.key_secret` and the server's `.key` (TeacherClient(curve=(client_secret_file,
server_public_file))). The files are zmq.auth certificates (Z85 text, no code).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import zmq.auth


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    g = sub.add_parser("generate", help="write NAME.key (public) and NAME.key_secret (keep private) into --out",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--out", type=Path, required=True, help="directory for the key files (created if missing)")
    g.add_argument("--name", default="server", help="file stem of the key pair, e.g. server or trainer1")
    g.add_argument("--force", action="store_true", help="overwrite an existing key pair of that name")


def generate(out: str | Path, name: str = "server", force: bool = False) -> tuple[Path, Path]:
    """Create a key pair; returns (public_file, secret_file). The secret file is chmod 600."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = out / f"{name}.key", out / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        raise FileExistsError(f"{public} or {secret} exists; pass --force to replace it")
    pub, sec = zmq.auth.create_certificates(str(out), name)
    Path(sec).chmod(0o600)
    return Path(pub), Path(sec)


def load_keypair(secret_file: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a NAME.key_secret file."""
    if not Path(secret_file).is_file():
        raise FileNotFoundError(f"{secret_file}: no such key file (`opd keys generate` writes NAME.key_secret)")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key; pass the .key_secret file")
    return public, secret


def load_public(path: str | Path) -> bytes:
    return zmq.auth.load_certificate(str(path))[0]


def load_allow_list(path: str | Path) -> set[bytes]:
    """Client public keys from one .key file or every .key file of a directory."""
    p = Path(path)
    files = sorted(p.glob("*.key")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no client public key files (*.key) at {p}")
    return {load_public(f) for f in files}


def client_curve_keys(curve) -> tuple[bytes, bytes, bytes] | None:
    """A TeacherClient's `curve` argument as (client_public, client_secret, server_public) keys.

    `curve`: None, those three keys (str or bytes), or (client_secret_file, server_public_file)."""
    if curve is None:
        return None
    if len(curve) == 2:
        pub, sec = zmq.auth.load_certificate(str(curve[0]))
        server_pub, _ = zmq.auth.load_certificate(str(curve[1]))
        if sec is None:
            raise ValueError(f"{curve[0]} holds no secret key (use the .key_secret file)")
        return pub, sec, server_pub
    return tuple(k.encode() if isinstance(k, str) else bytes(k) for k in curve)  # type: ignore[return-value]


def run(args) -> int:
    if args.keys_command == "generate":
        pub, sec = generate(args.out, args.name, args.force)
        print(f"public key: {pub}\nsecret key: {sec} (keep private)")
    return 0
