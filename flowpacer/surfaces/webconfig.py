"""The metrics endpoint's web configuration file (``--web.config.file``), in the convention of
the Prometheus exporters (their "exporter-toolkit" web configuration):

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_ca_file: ca.crt         # optional: verify client certificates against it
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (default),
                                                     # VerifyClientCertIfGiven
      min_version: TLS12             # or TLS13
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

Only these keys are known; any other is refused with a one-line reason rather than silently
ignored (a key that would have restricted access must never be dropped quietly). Checked
passwords are remembered (by a SHA-256 of user, password and hash) so that a scraper does not
pay bcrypt's cost on every scrape.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import ssl
from dataclasses import dataclass, field
from typing import Dict, Optional

from flowpacer.errors import FlowpacerError

TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version"}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
MIN_VERSION = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
MAX_CACHED = 64


class WebConfigError(FlowpacerError):
    pass


@dataclass
class WebConfig:
    path: str = ""
    tls: Optional[ssl.SSLContext] = None
    users: Dict[str, bytes] = field(default_factory=dict)     # name -> bcrypt hash
    _ok: Dict[bytes, bool] = field(default_factory=dict, repr=False)

    @property
    def auth(self) -> bool:
        return bool(self.users)

    def check(self, authorization: Optional[str]) -> bool:
        """True when the ``Authorization`` header value names a user with the right password
        (always True without ``basic_auth_users``)."""
        if not self.users:
            return True
        if not authorization:
            return False
        scheme, _, b64 = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(b64.strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return False
        if not sep:
            return False
        hashed = self.users.get(user)
        if hashed is None:
            return False
        memo = hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed))).digest()
        ok = self._ok.get(memo)
        if ok is None:
            import bcrypt
            try:
                ok = bcrypt.checkpw(password.encode(), hashed)
            except ValueError:
                ok = False
            if len(self._ok) >= MAX_CACHED:
                self._ok.clear()
            self._ok[memo] = ok
        return ok


def _mapping(v, where: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise WebConfigError(f"{where}: expected a mapping")
    return v


def load(path: str) -> WebConfig:
    """Read and check a web configuration file; WebConfigError with a one-line reason."""
    import yaml
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as e:
        raise WebConfigError(f"web config {path}: {e.strerror}") from None
    try:
        doc = yaml.safe_load(raw) or {}
    except yaml.YAMLError as e:
        raise WebConfigError(f"web config {path}: not YAML: {str(e).splitlines()[0]}") from None
    doc = _mapping(doc, f"web config {path}")
    unknown = set(doc) - {"tls_server_config", "basic_auth_users"}
    if unknown:
        raise WebConfigError(f"web config {path}: unsupported keys: {', '.join(sorted(map(str, unknown)))}")
    base = os.path.dirname(os.path.abspath(path))
    cfg = WebConfig(path=path)

    tls = _mapping(doc.get("tls_server_config"), f"web config {path}: tls_server_config")
    if tls:
        unknown = set(tls) - TLS_KEYS
        if unknown:
            raise WebConfigError(f"web config {path}: tls_server_config: unsupported keys: "
                                 f"{', '.join(sorted(map(str, unknown)))}")

        def file(k, required):
            v = tls.get(k)
            if v in (None, ""):
                if required:
                    raise WebConfigError(f"web config {path}: tls_server_config.{k} is required")
                return None
            if not isinstance(v, str):
                raise WebConfigError(f"web config {path}: tls_server_config.{k}: expected a path")
            return os.path.join(base, v)
        cert, key = file("cert_file", True), file("key_file", True)
        ca = file("client_ca_file", False)
        auth = tls.get("client_auth_type", "RequireAndVerifyClientCert" if ca else "NoClientCert")
        if auth not in CLIENT_AUTH:
            raise WebConfigError(f"web config {path}: client_auth_type {auth!r}: expected one of "
                                 f"{', '.join(CLIENT_AUTH)}")
        if CLIENT_AUTH[auth] != ssl.CERT_NONE and not ca:
            raise WebConfigError(f"web config {path}: client_auth_type {auth} needs client_ca_file")
        minv = tls.get("min_version", "TLS12")
        if minv not in MIN_VERSION:
            raise WebConfigError(f"web config {path}: min_version {minv!r}: expected TLS12 or TLS13")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = MIN_VERSION[minv]
        try:
            ctx.load_cert_chain(cert, key)
            if ca:
                ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise WebConfigError(f"web config {path}: TLS certificate or key: "
                                 f"{getattr(e, 'strerror', None) or e}") from None
        ctx.verify_mode = CLIENT_AUTH[auth]
        cfg.tls = ctx

    users = _mapping(doc.get("basic_auth_users"), f"web config {path}: basic_auth_users")
    for name, hashed in users.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise WebConfigError(f"web config {path}: basic_auth_users: bad user name {name!r}")
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"web config {path}: basic_auth_users.{name}: expected a bcrypt "
                                 "hash ($2a$, $2b$ or $2y$)")
        cfg.users[name] = hashed.encode()
    if cfg.users:
        try:
            import bcrypt  # noqa: F401  (checked now: a missing module is a start-up error)
        except ImportError:
            raise WebConfigError("basic_auth_users needs the bcrypt module (python3-bcrypt)") from None
    return cfg

