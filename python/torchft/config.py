"""Every setting of a training process, resolved in one place.

:class:`ManagerConfig` turns the :class:`~torchft.Manager` constructor's arguments and the
environment (torchrun's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, ``JOB_ID`` and
the ``TORCHFT_*`` variables) into one frozen object. Each setting is declared once, as a field
with its environment variable and how that variable relates to the argument:

- ``OVERRIDE``: the variable, when set, replaces the argument (operators raise a timeout
  without touching code);
- ``FALLBACK``: the variable is used when the argument is None (torchrun's environment).

Bad values fail the same way wherever they come from: a ``TypeError`` for an argument of the
wrong type, a ``ValueError`` naming the argument or the variable otherwise. Process groups and
checkpoint transports apply ``TORCHFT_TIMEOUT_SEC`` through :func:`timeout_override`, so that
variable means the same everywhere. The token and TLS variables are parsed by the native core
(the same parser the lighthouse and manager servers use) and reach Python only through
:func:`security_settings`; the checkpoint server's bind address through :func:`checkpoint_bind`,
and the network interface heals are served on through :func:`heal_ifname`.
:data:`ENV_VARS` lists every variable the package reads (``python -m torchft.config`` prints
them with their current values, secrets masked); nothing else in the package reads
``os.environ`` for a setting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any, Generic, TypeVar

__all__ = [
    "ENV_VARS",
    "HealIfname",
    "ManagerConfig",
    "WorldSizeMode",
    "checkpoint_bind",
    "env_flag",
    "env_value",
    "heal_ifname",
    "security_settings",
    "timeout_override",
]

V = TypeVar("V")


class WorldSizeMode(Enum):
    """How the number of contributing replica groups is chosen each step.

    DYNAMIC: every replica group at the max step contributes and gradients are averaged over
    all of them; the effective batch size follows the number of healthy groups.

    FIXED_WITH_SPARES: at most ``min_replica_size`` replica groups contribute; the others are
    hot spares that send zeros, so the effective batch size stays constant.
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


# ----------------------------------------------------------------------------- value kinds


@dataclass(frozen=True)
class Kind(Generic[V]):
    """How one kind of setting is checked (as an argument) and parsed (from a variable)."""

    #: What a value must be, for error messages ("a positive number of seconds").
    what: str
    #: Checks an argument value and returns it (raises TypeError/ValueError).
    check: Callable[[str, Any], V]
    #: Parses a variable's text (raises ValueError; the caller names the variable).
    parse: Callable[[str], V]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_seconds(name: str, v: Any) -> timedelta:
    if not isinstance(v, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, got {type(v).__name__}")
    if v <= timedelta(0):
        raise ValueError(f"{name} must be positive, got {v}")
    return v


def _parse_seconds(raw: str) -> timedelta:
    secs = float(raw)
    if not secs > 0 or secs == float("inf"):
        raise ValueError("not positive")
    return timedelta(seconds=secs)


def _int_kind(what: str, lo: int, hi: int | None = None) -> Kind[int]:
    def ok(v: int) -> bool:
        return v >= lo and (hi is None or v <= hi)

    def check(name: str, v: Any) -> int:
        if not _is_int(v):
            raise TypeError(f"{name} must be an int, got {v!r}")
        if not ok(v):
            raise ValueError(f"{name} must be {what}, got {v}")
        return int(v)

    def parse(raw: str) -> int:
        v = int(raw)
        if not ok(v):
            raise ValueError(what)
        return v

    return Kind(what, check, parse)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


def _parse_bool(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("not a switch")


def _check_text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {v!r}")
    if not v.strip():
        raise ValueError(f"{name} must not be empty")
    return v


def _parse_text(raw: str) -> str:
    return raw


#: Longest network interface name (Linux: IFNAMSIZ - 1).
_MAX_IFNAME = 15


def _parse_ifname(raw: str) -> str:
    bad = ("," in raw or "/" in raw) or any(c.isspace() for c in raw)
    if not raw or len(raw) > _MAX_IFNAME or bad:
        raise ValueError("not one interface name")
    return raw


def _check_ifname(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {v!r}")
    try:
        return _parse_ifname(v)
    except ValueError:
        raise ValueError(f"{name} must be {IFNAME.what}, got {v!r}") from None


def _check_dir(name: str, v: Any) -> str:
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    text = _check_text(name, v)
    return _parse_dir(text)


def _parse_dir(raw: str) -> str:
    if "://" in raw:
        # No object store stands behind a URL here: refuse it rather than write a local
        # directory named like one.
        raise ValueError(
            f"snapshot directory {raw!r} is a URL; only a directory path is supported "
            "(a shared file system mounted on every host)"
        )
    if "\x00" in raw:
        raise ValueError("a directory path cannot contain NUL")
    return raw


def _check_name(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {v!r}")
    return v


#: A job (room) name, as the lighthouse accepts it (empty: the default room).
_JOB_NAME = re.compile(r"(?![.])[A-Za-z0-9._-]{1,64}")


def _check_job(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {v!r}")
    if v and _JOB_NAME.fullmatch(v) is None:
        raise ValueError(
            f"{name} must be 1 to 64 ASCII letters, digits, '-', '_' or '.', not starting "
            f"with '.' (empty: the lighthouse's default room), got {v!r}"
        )
    return v


def _parse_job(raw: str) -> str:
    return _check_job("TORCHFT_JOB", raw.strip())


def _check_mode(name: str, v: Any) -> WorldSizeMode:
    if not isinstance(v, WorldSizeMode):
        raise TypeError(f"{name} must be a WorldSizeMode, got {v!r}")
    return v


#: What a process does when the lighthouse holds its replica group hung (see torchft.hang).
HANG_ACTIONS: tuple[str, ...] = ("exit", "keep")


def _check_hang_action(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, got {v!r}")
    if v not in HANG_ACTIONS:
        raise ValueError(f"{name} must be one of {', '.join(HANG_ACTIONS)}, got {v!r}")
    return v


def _parse_hang_action(raw: str) -> str:
    if raw.strip().lower() not in HANG_ACTIONS:
        raise ValueError("not an action")
    return raw.strip().lower()


def _parse_mode(raw: str) -> WorldSizeMode:
    try:
        return WorldSizeMode[raw.upper()]
    except KeyError:
        raise ValueError("not a mode") from None


SECONDS: Kind[timedelta] = Kind("a positive number of seconds", _check_seconds, _parse_seconds)
COUNT: Kind[int] = _int_kind("an integer >= 0", 0)
POSITIVE: Kind[int] = _int_kind("an integer >= 1", 1)
PORT: Kind[int] = _int_kind("a port in 0..65535", 0, 65535)
STORE_PORT: Kind[int] = _int_kind("a port in 1..65535", 1, 65535)
SWITCH: Kind[bool] = Kind("one of 1/true/yes/on or 0/false/no/off", _check_bool, _parse_bool)
TEXT: Kind[str] = Kind("a non-empty string", _check_text, _parse_text)
NAME: Kind[str] = Kind("a string", _check_name, _parse_text)
JOB: Kind[str] = Kind(
    "a job name (letters, digits, '-', '_', '.'; at most 64)", _check_job, _parse_job
)
MODE: Kind[WorldSizeMode] = Kind("DYNAMIC or FIXED_WITH_SPARES", _check_mode, _parse_mode)
DIRECTORY: Kind[str] = Kind("a directory path (no URL)", _check_dir, _parse_dir)
HANG_ACTION: Kind[str] = Kind("exit or keep", _check_hang_action, _parse_hang_action)
IFNAME: Kind[str] = Kind(
    f"one network interface name (e.g. eth0; at most {_MAX_IFNAME} characters)",
    _check_ifname,
    _parse_ifname,
)


# ----------------------------------------------------------------------------- variables


class Source(Enum):
    """How a variable relates to its constructor argument."""

    OVERRIDE = "overrides the argument when set"
    FALLBACK = "used when the argument is None"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable the package reads."""

    name: str
    kind: Kind[Any]
    help: str
    source: Source = Source.FALLBACK
    #: Never printed (``python -m torchft.config`` shows only whether it is set).
    secret: bool = False

    def read(self, env: Mapping[str, str]) -> Any | None:
        """The variable's value, None when unset or blank.

        Raises:
            ValueError: naming the variable, when the text is not a valid value.
        """
        raw = env.get(self.name)
        if raw is None or not raw.strip():
            return None
        try:
            return self.kind.parse(raw.strip())
        except ValueError:
            raise ValueError(f"env {self.name}={raw!r} must be {self.kind.what}") from None


def _setting(
    kind: Kind[Any],
    default: Any = None,
    env: str | None = None,
    source: Source = Source.FALLBACK,
    help: str = "",
    required: bool = False,
    only_with: str | None = None,
) -> Any:
    """Declares one ManagerConfig field (its kind, default and variable).

    ``only_with`` names an earlier field: the variable is read (and validated) only when that
    field resolved to a value, so a job that uses the variable's name for something else is
    not refused.
    """
    meta: dict[str, Any] = {"kind": kind, "required": required, "only_with": only_with}
    if env is not None:
        meta["env"] = EnvVar(env, kind, help, source)
    return dataclasses.field(default=default, metadata=meta)


def _timeout(env: str, help: str) -> Any:
    """Declares one of the Manager's three timeouts: a minute by default, and a variable in
    seconds that overrides the argument when set."""
    return _setting(SECONDS, timedelta(seconds=60), env=env, source=Source.OVERRIDE, help=help)


# ----------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class ManagerConfig:
    """The resolved settings of one :class:`~torchft.Manager` (see the module docs).

    Build it with :meth:`resolve`; the fields are documented on the Manager's constructor.
    """

    min_replica_size: int = _setting(POSITIVE, required=True)
    use_async_quorum: bool = _setting(SWITCH, True)
    timeout: timedelta = _timeout(
        "TORCHFT_TIMEOUT_SEC",
        "timeout of collectives, checkpoint transfer and commit votes (seconds)",
    )
    quorum_timeout: timedelta = _timeout(
        "TORCHFT_QUORUM_TIMEOUT_SEC", "deadline of one quorum request (seconds)"
    )
    connect_timeout: timedelta = _timeout(
        "TORCHFT_CONNECT_TIMEOUT_SEC",
        "deadline for connecting to the store and the manager server (seconds)",
    )
    rank: int = _setting(COUNT, env="RANK", help="group rank (torchrun)", required=True)
    world_size: int = _setting(
        POSITIVE, env="WORLD_SIZE", help="ranks in the replica group (torchrun)", required=True
    )
    world_size_mode: WorldSizeMode = _setting(MODE, WorldSizeMode.DYNAMIC)
    store_addr: str = _setting(
        TEXT, env="MASTER_ADDR", help="host of the replica group's TCPStore", required=True
    )
    store_port: int = _setting(
        STORE_PORT, env="MASTER_PORT", help="port of the replica group's TCPStore", required=True
    )
    restart_count: int = _setting(
        COUNT,
        0,
        env="TORCHELASTIC_RESTART_COUNT",
        help="times torchrun's agent restarted this worker (names the group's store entries)",
    )
    lighthouse_addr: str = _setting(
        TEXT, env="TORCHFT_LIGHTHOUSE", help="lighthouse address (http://host:port)", required=True
    )
    replica_id: str | None = _setting(NAME)
    port: int = _setting(
        PORT, 0, env="TORCHFT_MANAGER_PORT", help="port of the manager server (0: any)"
    )
    hostname: str = _setting(NAME, "")
    heartbeat_interval: timedelta = _setting(SECONDS, timedelta(milliseconds=100))
    init_sync: bool = _setting(SWITCH, True)
    max_retries: int | None = _setting(COUNT)
    quorum_retries: int = _setting(
        COUNT,
        0,
        env="TORCHFT_QUORUM_RETRIES",
        source=Source.OVERRIDE,
        help="how often the manager server retries a failed lighthouse quorum",
    )
    sparse_quorum: bool = _setting(
        SWITCH,
        True,
        env="TORCHFT_SPARSE_QUORUM",
        help="without a topology file, ask the lighthouse for each group's own quorum answer "
        "and the few members it names, not the whole member list (off: every "
        "QuorumResult.replica_ids names every member)",
    )
    telemetry: bool = _setting(
        SWITCH, True, env="TORCHFT_TELEMETRY", help="per-step telemetry to the lighthouse"
    )
    job_id: str = _setting(TEXT, "unknown", env="JOB_ID", help="job name in structured logs")
    job: str = _setting(
        JOB,
        "",
        env="TORCHFT_JOB",
        help="the job's room on a lighthouse shared by many jobs: its quorums, ids and events "
        "are its own (empty: the lighthouse's default room)",
    )
    hang_action: str = _setting(
        HANG_ACTION,
        "exit",
        env="TORCHFT_HANG_ACTION",
        help="when the lighthouse holds this replica group hung: dump every thread's stack, "
        "then exit with code 76 for the supervisor to restart the process (exit), or stay "
        "(keep: the group rejoins and heals when its training loop comes back)",
    )
    parity_every: int = _setting(
        COUNT,
        100,
        env="TORCHFT_PARITY_EVERY",
        help="runtime state parity: every this many committed steps each rank digests its "
        "committed state and the lighthouse compares the groups' digests (0: off)",
    )
    snapshot_dir: str | None = _setting(
        DIRECTORY,
        env="TORCHFT_SNAPSHOT_DIR",
        help="durable snapshots: directory (shared by every replica group) that one replica "
        "group writes its committed state to every TORCHFT_SNAPSHOT_EVERY committed steps, "
        "and that a job whose every group died resumes from (unset: off)",
    )
    snapshot_every: int = _setting(
        POSITIVE,
        500,
        env="TORCHFT_SNAPSHOT_EVERY",
        help="committed steps between two durable snapshots (read with TORCHFT_SNAPSHOT_DIR)",
        only_with="snapshot_dir",
    )
    snapshot_keep: int = _setting(
        POSITIVE,
        3,
        env="TORCHFT_SNAPSHOT_KEEP",
        help="complete durable snapshots kept; older ones are deleted (read with "
        "TORCHFT_SNAPSHOT_DIR)",
        only_with="snapshot_dir",
    )
    topology_file: str | None = _setting(
        TEXT,
        env="WORLD_TOPOLOGY_FILE",
        help="the job's topology file (JSON, version 0.1): healing groups pull from the "
        "best-connected up-to-date group (else one on the same host)",
    )
    replica_group_index: int | None = _setting(
        COUNT,
        env="REPLICA_GROUP_ID",
        help="this replica group's index in the job; its ranks in WORLD_TOPOLOGY_FILE are "
        "REPLICA_GROUP_ID * WORLD_SIZE + RANK (read only when WORLD_TOPOLOGY_FILE is set)",
        only_with="topology_file",
    )

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **args: Any) -> ManagerConfig:
        """Resolves constructor arguments against the environment.

        Args:
            env: the environment (default ``os.environ``).
            **args: the Manager's constructor arguments; None means "not given".

        Returns:
            The frozen config.

        Raises:
            TypeError: an argument has the wrong type.
            ValueError: an argument or a variable has a bad value, or a required setting is
                neither given nor in the environment (the message names both).
        """
        env = os.environ if env is None else env
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(args) - set(fields)
        if unknown:
            raise TypeError(f"unknown Manager settings: {sorted(unknown)}")
        values: dict[str, Any] = {}
        for name, f in fields.items():
            kind: Kind[Any] = f.metadata["kind"]
            var: EnvVar | None = f.metadata.get("env")
            value = args.get(name)
            if value is not None:
                value = kind.check(name, value)
            only_with = f.metadata["only_with"]
            applies = only_with is None or values[only_with] is not None
            if var is not None and applies and (value is None or var.source is Source.OVERRIDE):
                from_env = var.read(env)
                if from_env is not None:
                    value = from_env
            if value is None:
                if f.metadata["required"]:
                    where = f" and env {var.name} is not set" if var is not None else ""
                    raise ValueError(f"{name} not given{where}")
                value = f.default
            values[name] = value
        if not values["rank"] < values["world_size"]:
            raise ValueError(f"rank must be in [0, {values['world_size']}), got {values['rank']}")
        if values["topology_file"] is not None and values["replica_group_index"] is None:
            raise ValueError(
                "env WORLD_TOPOLOGY_FILE is set but REPLICA_GROUP_ID is not: the file's ranks "
                "are REPLICA_GROUP_ID * WORLD_SIZE + RANK, so each replica group needs its index"
            )
        if not values["hostname"]:
            values["hostname"] = socket.gethostname()
        return cls(**values)


# ----------------------------------------------------------------------------- other readers

#: Parsed by the native core (``Security::from_env``), read in Python through
#: :func:`security_settings` only.
_NATIVE_PATH = Kind("a path to a readable file", _check_text, _parse_text)
_NATIVE_TOKEN = Kind("visible ASCII characters, at most 4 KiB", _check_text, _parse_text)

#: Variables read outside the Manager (process groups, transports, the native core).
_OTHER_VARS = (
    EnvVar(
        "TORCHFT_LOG",
        TEXT,
        "native log filter (EnvFilter syntax, e.g. info or warn,torchft::manager=debug); "
        "else RUST_LOG, else warn",
    ),
    EnvVar(
        "TORCHFT_RUNTIME_THREADS",
        POSITIVE,
        "worker threads of the native runtime (one per core beyond the training thread, 1 "
        "or 2; the lighthouse daemon: one per core)",
    ),
    EnvVar(
        "TORCHFT_TOKEN_FILE",
        _NATIVE_PATH,
        "file holding the job's shared secret (wins over TORCHFT_TOKEN)",
    ),
    EnvVar("TORCHFT_TOKEN", _NATIVE_TOKEN, "the job's shared secret itself", secret=True),
    EnvVar("TORCHFT_TLS_CERT", _NATIVE_PATH, "PEM certificate chain served (and presented)"),
    EnvVar("TORCHFT_TLS_KEY", _NATIVE_PATH, "PEM private key of TORCHFT_TLS_CERT"),
    EnvVar("TORCHFT_TLS_CA", _NATIVE_PATH, "PEM CA servers are verified against (dial TLS)"),
    EnvVar(
        "TORCHFT_TLS_CLIENT_CA",
        _NATIVE_PATH,
        "PEM CA client certificates must be signed by (servers require one)",
    ),
    EnvVar(
        "TORCHFT_CHECKPOINT_BIND",
        TEXT,
        "address the checkpoint server listens on (e.g. :: for every interface); "
        "else the heal interface's address (TORCHFT_HEAL_IFNAME), else the advertised host "
        "name's addresses",
    ),
    EnvVar(
        "TORCHFT_HEAL_IFNAME",
        IFNAME,
        "network interface heals are served on: the checkpoint server listens on its address "
        "and advertises it (IPv4, else global IPv6); else the first name of GLOO_SOCKET_IFNAME, "
        "else of NCCL_SOCKET_IFNAME, else the host name. A Manager hostname= given wins",
    ),
    EnvVar(
        "GLOO_SOCKET_IFNAME",
        TEXT,
        "gloo's interfaces (comma-separated); the first is the default of TORCHFT_HEAL_IFNAME",
    ),
    EnvVar(
        "NCCL_SOCKET_IFNAME",
        TEXT,
        "NCCL's interfaces (=exact names, ^excluded ones, else name prefixes); the first is "
        "the default of TORCHFT_HEAL_IFNAME when GLOO_SOCKET_IFNAME is unset (^ lists: none)",
    ),
    EnvVar(
        "TORCHFT_USE_OTEL",
        SWITCH,
        "export the records of the loggers given to torchft.otel.setup_logger (upstream "
        "torchft's switch) over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (off)",
    ),
    EnvVar(
        "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON",
        TEXT,
        "JSON file mapping a logger name to the OTLP resource attributes of its records "
        "(read with TORCHFT_USE_OTEL)",
    ),
    EnvVar(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        TEXT,
        "base URL of the OTLP/HTTP collector (e.g. http://otel-collector:4318): where "
        "python -m torchft.otel sends when --endpoint is not given (the OpenTelemetry SDK "
        "reads it too)",
    ),
)

#: Every variable the package reads, by name.
ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        *(f.metadata["env"] for f in dataclasses.fields(ManagerConfig) if "env" in f.metadata),
        *_OTHER_VARS,
    )
}

_TIMEOUT = ENV_VARS["TORCHFT_TIMEOUT_SEC"]


def timeout_override(timeout: timedelta, env: Mapping[str, str] | None = None) -> timedelta:
    """Applies ``TORCHFT_TIMEOUT_SEC`` to a timeout given to a process group or transport.

    Args:
        timeout: the timeout the caller passed.
        env: the environment (default ``os.environ``).

    Returns:
        The variable's value when set, else ``timeout``.

    Raises:
        ValueError: naming the variable, when it is set to something else than a positive
            number of seconds.
    """
    value = _TIMEOUT.read(os.environ if env is None else env)
    return timeout if value is None else value


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Reads a registered on/off variable (e.g. ``TORCHFT_TELEMETRY``).

    Raises:
        ValueError: naming the variable on a value that is not a switch.
    """
    value = ENV_VARS[name].read(os.environ if env is None else env)
    return default if value is None else bool(value)


def env_value(name: str, env: Mapping[str, str] | None = None) -> Any | None:
    """Reads a registered variable (None when unset or blank).

    Args:
        name: a key of :data:`ENV_VARS` (a typo is a KeyError, not a silent None).
        env: the environment (default ``os.environ``).

    Raises:
        ValueError: naming the variable, when its value is invalid.
    """
    return ENV_VARS[name].read(os.environ if env is None else env)


def adopt_environment(env: Mapping[str, str]) -> None:
    """Replaces this process's whole environment with ``env`` (a warm standby taking the
    identity of the process it replaces); every setting read afterwards sees ``env``."""
    os.environ.clear()
    os.environ.update(env)


def checkpoint_bind(env: Mapping[str, str] | None = None) -> str | None:
    """The checkpoint server's bind address from ``TORCHFT_CHECKPOINT_BIND`` (None: unset)."""
    value = env_value("TORCHFT_CHECKPOINT_BIND", env)
    return None if value is None else str(value)


_HEAL_IFNAME = "TORCHFT_HEAL_IFNAME"


@dataclass(frozen=True)
class HealIfname:
    """The network interface heals are served on, as configured (see :func:`heal_ifname`)."""

    #: The interface's name, or (``prefix``) the start of its name.
    name: str
    #: The variable it came from, for error messages.
    variable: str
    #: NCCL's plain form: ``name`` may be the start of the interface's name (``eth`` for
    #: ``eth0``), the first interface so named is meant.
    prefix: bool = False

    def describe(self) -> str:
        """``VAR=name``, and why that variable counts when it is not TORCHFT_HEAL_IFNAME."""
        why = "" if self.variable == _HEAL_IFNAME else " (TORCHFT_HEAL_IFNAME is unset)"
        return f"{self.variable}={self.name}{why}"


def heal_ifname(env: Mapping[str, str] | None = None) -> HealIfname | None:
    """The network interface this process serves heals on, from the environment.

    ``TORCHFT_HEAL_IFNAME`` (one name), else the first name of ``GLOO_SOCKET_IFNAME``
    (a comma-separated list), else the first name of ``NCCL_SOCKET_IFNAME``: ``=eth0,eth1``
    names exact interfaces, ``eth`` the start of their names (NCCL's default form), and an
    exclusion list (``^docker,lo``) names none. The interface's address is looked up by the
    checkpoint transport (``torchft.checkpointing._interface``).

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        The interface and the variable naming it; None when no variable names one (heals
        then use the advertised host name, as without this setting).

    Raises:
        ValueError: naming the variable, when ``TORCHFT_HEAL_IFNAME`` is not one interface
            name.
    """
    env = os.environ if env is None else env
    own = env_value(_HEAL_IFNAME, env)
    if own is not None:
        return HealIfname(str(own), _HEAL_IFNAME)
    gloo = env_value("GLOO_SOCKET_IFNAME", env)
    if gloo is not None:
        first = _first_name(str(gloo))
        if first:
            return HealIfname(first, "GLOO_SOCKET_IFNAME")
    nccl = env_value("NCCL_SOCKET_IFNAME", env)
    if nccl is not None and not str(nccl).startswith("^"):
        exact = str(nccl).startswith("=")
        first = _first_name(str(nccl).removeprefix("="))
        if first:
            return HealIfname(first, "NCCL_SOCKET_IFNAME", prefix=not exact)
    return None


def _first_name(names: str) -> str | None:
    """The first non-empty name of a comma-separated list (None: there is none)."""
    for name in names.split(","):
        if name.strip():
            return name.strip()
    return None


def security_settings() -> dict[str, str | None]:
    """This process's token and TLS files (``TORCHFT_TOKEN_FILE``/``TORCHFT_TOKEN``/
    ``TORCHFT_TLS_*``), parsed by the native core exactly as its servers parse them.

    Returns:
        Keys ``token``, ``tls_cert``, ``tls_key``, ``tls_ca``, ``tls_client_ca`` (None: unset).

    Raises:
        ValueError: naming the variable, on an unreadable token file, a malformed token, a
            missing TLS file or an incomplete TLS combination.
    """
    from torchft import _torchft

    return _torchft.security_settings()


def main() -> int:
    """Prints every variable the package reads, with its current value (secrets masked)."""
    for var in ENV_VARS.values():
        current = os.environ.get(var.name)
        if current is None:
            shown = "(unset)"
        elif var.secret:
            shown = "(set)"
        else:
            shown = repr(current)
        print(f"{var.name:<30} {shown:<20} {var.help} [{var.source.value}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())


class ThisHost(str):
    """The default of ``Manager(hostname=)``: this machine's name, marked as not given, so
    the heal interface (``TORCHFT_HEAL_IFNAME``) wins over it while a given name wins over
    the interface."""

    __slots__ = ()


#: This machine's name, as the Manager's default ``hostname``.
THIS_HOST = ThisHost(socket.gethostname())
