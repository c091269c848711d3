"""The server-side policy: who is enrolled with which role, each method's minimum role, quotas,
and the revocation deny-list. Format and meaning: docs/remote.md.

The policy file and the deny-list are re-read when their modification time or size changes
(checked on every call, a `stat` each), so enrolment and revocation take effect without a restart.
A file that no longer parses is refused and the last good policy stays in force (logged).
"""

from __future__ import annotations

import hashlib
import os
import threading
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinydist.base.errors import TinydistError
from tinydist.base.logs import get_logger
from tinydist.security.pki import PKIError, check_private

ROLES = ("viewer", "operator", "admin")
RANK = {role: rank for rank, role in enumerate(ROLES)}

# Methods that need an elevation token on top of the admin role. Fixed in code: a policy file can
# raise a method's role, never lower it below these floors or remove the token requirement.
ELEVATED = frozenset({"LoadRawProgram", "ResetDevice", "PciConfigRead", "BarRead", "BarWrite"})
FLOORS = {**{m: "admin" for m in ELEVATED}, "MintElevationToken": "admin"}

DEFAULT_METHODS = {
    "Ping": "viewer", "WhoAmI": "viewer", "ListDevices": "viewer", "ListPciFunctions": "viewer",
    "OpenLease": "operator", "RenewLease": "operator", "CloseLease": "operator", "Allocate": "operator",
    "Free": "operator", "Write": "operator", "WriteStream": "operator", "Read": "operator",
    "ReadStream": "operator", "Copy": "operator", "LoadProgram": "operator", "Launch": "operator",
    "MintElevationToken": "admin", "LoadRawProgram": "admin", "ResetDevice": "admin",
    "PciConfigRead": "admin", "BarRead": "admin", "BarWrite": "admin",
}
MAX_TOKEN_TTL = 60.0


class PolicyError(TinydistError, ValueError):
    """The policy file is missing or invalid; the message names the key."""


@dataclass(frozen=True)
class Quota:
    max_bytes: int = 1 << 30          # bytes allocated at once, per identity
    rpc_per_second: float = 2000.0    # token-bucket refill rate, per identity
    rpc_burst: float = 4000.0         # bucket size
    max_leases: int = 16              # open leases at once, per identity
    max_handles: int = 65536          # live allocations at once, per identity
    # Calls in progress at once, per identity, checked when a call starts: with the node's global cap
    # of 256 (ServerConfig.max_concurrent_rpcs) no identity holding its own caps can fill it alone.
    max_calls: int = 64
    max_streams: int = 16             # of which streaming calls (WriteStream, ReadStream)
    max_programs: int = 256           # programs loaded at once, per identity; unloaded with their lease
    max_program_bytes: int = 64 << 20  # their LLVM IR and object code together, per identity
    resets_per_minute: int = 6        # ResetDevice calls in any 60 s, per identity


@dataclass(frozen=True)
class Policy:
    trust_domain: str
    identities: dict[str, str]
    methods: dict[str, str]
    quota: Quota
    identity_quotas: dict[str, Quota] = field(default_factory=dict)
    token_ttl: float = 30.0
    deny_list_path: Path | None = None

    def role_of(self, identity: str) -> str | None:
        return self.identities.get(identity)

    def min_role(self, method: str) -> str | None:
        """The role a method needs, or None if the table does not list it (then it is refused)."""
        role = self.methods.get(method)
        if role is None:
            return None
        floor = FLOORS.get(method)
        if floor is not None and RANK[floor] > RANK[role]:
            return floor
        return role

    def quota_of(self, identity: str) -> Quota:
        return self.identity_quotas.get(identity, self.quota)


def _quota(table: Any, where: str, base: Quota) -> Quota:
    if not isinstance(table, dict):
        raise PolicyError(f"{where} must be a table")
    values = {}
    for key, value in table.items():
        if key not in Quota.__dataclass_fields__:
            raise PolicyError(f"{where}.{key} is not a quota; known: {', '.join(Quota.__dataclass_fields__)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise PolicyError(f"{where}.{key} must be a positive number, got {value!r}")
        values[key] = value
    merged = {**base.__dict__, **values}
    return Quota(**merged)


def parse_policy(text: str, base_dir: Path) -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"policy is not valid TOML: {exc}") from exc
    trust_domain = data.get("trust_domain")
    if not isinstance(trust_domain, str) or not trust_domain or "/" in trust_domain:
        raise PolicyError("policy needs trust_domain = \"<domain>\" (e.g. \"tinydist.lab\")")
    identities = data.get("identities", {})
    if not isinstance(identities, dict):
        raise PolicyError("[identities] must map \"spiffe://<trust-domain>/user/<name>\" to a role")
    prefix = f"spiffe://{trust_domain}/user/"
    for identity, role in identities.items():
        if not identity.startswith(prefix) or len(identity) == len(prefix):
            raise PolicyError(f"identity {identity!r} is not of the form {prefix}<name>")
        if role not in RANK:
            raise PolicyError(f"identity {identity!r} has unknown role {role!r}; roles: {', '.join(ROLES)}")
    methods = data.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise PolicyError("policy needs a [methods] table (method = minimum role); methods not listed are refused")
    for method, role in methods.items():
        if role not in RANK:
            raise PolicyError(f"method {method!r} has unknown role {role!r}; roles: {', '.join(ROLES)}")
    quotas = data.get("quotas", {})
    if not isinstance(quotas, dict):
        raise PolicyError("[quotas] must be a table")
    per_identity = quotas.get("identities", {})
    quota = _quota({k: v for k, v in quotas.items() if k != "identities"}, "quotas", Quota())
    identity_quotas = {ident: _quota(table, f"quotas.identities.{ident!r}", quota) for ident, table in per_identity.items()}
    elevation = data.get("elevation", {})
    ttl = elevation.get("token_ttl_seconds", 30)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= MAX_TOKEN_TTL:
        raise PolicyError(f"elevation.token_ttl_seconds must be in (0, {MAX_TOKEN_TTL:g}], got {ttl!r}")
    revocation = data.get("revocation", {})
    deny = revocation.get("deny_list", "revoked.txt")
    if not isinstance(deny, str):
        raise PolicyError("revocation.deny_list must be a path (relative to the policy file)")
    return Policy(trust_domain, dict(identities), dict(methods), quota, identity_quotas, float(ttl), base_dir / deny)


def parse_deny_list(text: str) -> frozenset[str]:
    entries = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip().replace(":", "").lower()
        if line:
            if len(line) != 64 or any(c not in "0123456789abcdef" for c in line):
                raise PolicyError(f"deny-list entry {line!r} is not a sha256 fingerprint (64 hex digits)")
            entries.add(line)
    return frozenset(entries)


def _stamp(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size)


class PolicyStore:
    """The policy in force, reloaded when its files change. Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.log = get_logger(component="policy", path=str(self.path))
        self._lock = threading.Lock()
        stamp = _stamp(self.path)
        if stamp is None:
            raise PolicyError(f"no policy file at {self.path}; `tinydist certs init DIR` writes a starter policy.toml")
        self._policy = self._parse()
        self._stamp = stamp
        self._denied, self._deny_stamp = self._read_deny(self._policy)
        self._paths: tuple[Policy | None, str, str | None] = (None, "", None)  # the policy they are of, its file, its deny-list

    def _parse(self) -> Policy:
        """The policy file read and parsed, refused where another user could have written it; its
        sha256 logged, so an audit can tell which policy was in force when."""
        check_private(self.path.parent, "the policy's folder")
        check_private(self.path, "the policy")
        data = self.path.read_bytes()
        policy = parse_policy(data.decode(), self.path.parent)
        self._note("info", "policy loaded", sha256=hashlib.sha256(data).hexdigest(), identities=len(policy.identities))
        return policy

    def _read_deny(self, policy: Policy) -> tuple[frozenset[str], tuple[int, int] | None]:
        path = policy.deny_list_path
        stamp = _stamp(path) if path is not None else None
        if path is None or stamp is None:
            return frozenset(), stamp
        check_private(path, "the deny-list")
        return parse_deny_list(path.read_text()), stamp

    def _note(self, level: str, event: str, **fields: object) -> None:
        try:
            getattr(self.log, level)(event, **fields)
        except (ValueError, OSError):
            pass  # a broken log stream must not turn a policy reload into a failed call

    def current(self) -> tuple[Policy, frozenset[str]]:
        """The policy and deny-list in force, re-read first if either file changed (two `stat`s a call,
        through str paths: a pathlib path costs two more Python calls for each, on every RPC)."""
        policy = self._policy
        if self._paths[0] is not policy:
            self._paths = (policy, str(self.path), str(policy.deny_list_path) if policy.deny_list_path is not None else None)
        stamp = _stamp(self._paths[1])
        deny_stamp = _stamp(self._paths[2]) if self._paths[2] is not None else None
        if stamp == self._stamp and deny_stamp == self._deny_stamp:
            return policy, self._denied
        with self._lock:
            if stamp != self._stamp and stamp is not None:
                try:
                    self._policy = self._parse()
                except (PolicyError, PKIError, OSError) as exc:
                    self._note("error", "policy reload refused; the previous policy stays in force", error=str(exc))
                self._stamp = stamp
            try:
                self._denied, self._deny_stamp = self._read_deny(self._policy)
            except (PolicyError, PKIError, OSError) as exc:
                # A broken deny-list must not un-revoke anyone: keep the old set.
                self._note("error", "deny-list reload refused; the previous list stays in force", error=str(exc))
                self._deny_stamp = _stamp(self._policy.deny_list_path) if self._policy.deny_list_path else None
            return self._policy, self._denied


def starter_policy(trust_domain: str) -> str:
    methods = "\n".join(f'{name} = "{role}"' for name, role in DEFAULT_METHODS.items())
    return f'''# tinydist node policy (docs/remote.md). Re-read on change; no restart needed.
trust_domain = "{trust_domain}"

# identity (the single URI SAN of a client certificate) = role: viewer < operator < admin
[identities]
# "spiffe://{trust_domain}/user/alice" = "admin"

# Minimum role per RPC. A method missing here is refused. Admin methods marked elevated in
# docs/remote.md also need a short-lived token; that cannot be switched off here.
[methods]
{methods}

[elevation]
token_ttl_seconds = 30   # at most 60

[quotas]                 # per identity; [quotas.identities."spiffe://..."] overrides
max_bytes = 1073741824
rpc_per_second = 2000
rpc_burst = 4000
max_leases = 16
max_handles = 65536
max_calls = 64           # calls in progress at once (checked when a call starts)
max_streams = 16         # of which WriteStream / ReadStream
max_programs = 256       # programs loaded at once; unloaded when their lease ends
max_program_bytes = 67108864
resets_per_minute = 6

[revocation]
deny_list = "revoked.txt"   # sha256 certificate fingerprints, one a line; re-read on change
'''


def _replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` at once (a temporary file renamed over it: a node re-reading it never
    sees half a file), keeping its mode; group and others never get write access."""
    mode = (os.stat(path).st_mode & 0o755) if path.exists() else 0o644
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def enrol(path: Path, identity: str, role: str) -> str | None:
    """Give `identity` `role` in the policy file at `path` (`tinydist certs enrol`): its line under
    [identities] is replaced, or added after the header; comments and everything else stay as they
    are. The edited text must parse as a policy before it replaces the file. Returns the old role."""
    path = Path(path)
    if role not in RANK:
        raise PolicyError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    check_private(path, "the policy file")
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise PolicyError(f"no policy file at {path}; `tinydist certs init` writes one") from exc
    old = parse_policy(text, path.parent).role_of(identity)
    line = f'"{identity}" = "{role}"'
    lines = text.splitlines()
    section = None
    at = None
    for i, current in enumerate(lines):
        stripped = current.strip()
        if stripped.startswith("["):
            section = stripped.split("#", 1)[0].strip()
            if section == "[identities]":
                at = i + 1
            continue
        if section == "[identities]" and stripped.split("=", 1)[0].strip().strip('"') == identity:
            lines[i] = line
            break
    else:
        if at is None:   # no table yet: at the end (a key above the first header would be top-level)
            lines += ["", "[identities]", line]
        else:
            lines.insert(at, line)
    edited = "\n".join(lines) + "\n"
    if parse_policy(edited, path.parent).role_of(identity) != role:
        raise PolicyError(f"could not enrol {identity} in {path}: the edited file does not give it {role}; edit it by hand")
    _replace_file(path, edited)
    return old


def revoke(path: Path, fingerprint: str, note: str = "") -> bool:
    """Put a certificate's sha256 `fingerprint` on the deny-list the policy at `path` names (`tinydist
    certs revoke`); every node reading that policy refuses it from its next call. False if it was there."""
    policy = parse_policy(Path(path).read_text(), Path(path).parent)
    deny = policy.deny_list_path or Path(path).parent / "revoked.txt"
    entry = fingerprint.replace(":", "").strip().lower()
    parse_deny_list(entry)  # refuses anything but 64 hex digits
    check_private(deny, "the deny-list")
    text = deny.read_text() if deny.exists() else "# sha256 fingerprints (hex) of revoked client certificates, one a line\n"
    if entry in parse_deny_list(text):
        return False
    _replace_file(deny, text + ("" if text.endswith("\n") or not text else "\n") + entry + (f"  # {note}" if note else "") + "\n")
    return True
