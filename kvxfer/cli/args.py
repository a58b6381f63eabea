"""Argument types and the parser class: every value is checked while the command line is read.

A type here either returns a usable value or raises ``argparse.ArgumentTypeError``
with ``<what> (<how to fix>)``; the parser turns that (and argparse's own
complaints) into a :class:`~kvxfer.cli.errors.UsageError`, so a mistake ends
with one line and exit status 2 before anything runs.
"""

from __future__ import annotations

import argparse
import os
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

from kvxfer.cli.errors import UsageError
from kvxfer.defaults import (ETCD_POLL_S, ETCD_TTL_S, MAX_TIMEOUT_S, MIN_TIMEOUT_S, SettingError, bounded_float,
                             bounded_int, figure)

#: Commands whose harness drives a push backend as well as pulls (the processes join a
#: torch.distributed group). The other (soak) drives pulls only.
PUSH_COMMANDS = frozenset({"loopback", "bench", "generate"})

#: The subcommand whose arguments are being parsed (its parser sets it), so that one
#: ``--backend`` type can tell a command that drives pushes from one that does not.
_parsing_command: ContextVar[str] = ContextVar("kvxfer_cli_parsing_command", default="")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are :class:`UsageError` (the caller prints them)."""

    def parse_known_args(self, args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> Any:
        command = self.prog.split()[-1] if " " in self.prog else ""
        token = _parsing_command.set(command) if command else None
        try:
            return super().parse_known_args(args, namespace)
        finally:
            if token is not None:
                _parsing_command.reset(token)

    def error(self, message: str) -> NoReturn:
        fix = "" if message.rstrip().endswith(")") else f"see '{self.prog} --help'"
        raise UsageError(message, fix)


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option that has a meaningful default, and a numeric option's range."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        bounds = getattr(action.type, "bounds", None)
        if bounds:
            text = f"{text}; {figure(bounds[0])} to {figure(bounds[1])}"
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
            return text
        if isinstance(action.default, (tuple, list)):
            return f"{text} (default: {','.join(str(v) for v in action.default)})"
        return f"{text} (default: %(default)s)"


#: The largest seed a run takes: numpy's and torch's generators are seeded with 32 bits here.
MAX_SEED = 2**32 - 1


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """A type: an integer in ``[low, high]`` (``kvxfer.defaults.bounded_int``: ``inf``, ``1e308`` and
    ``10**30`` are refused, not just the negative). Its ``bounds`` attribute is the range, so that
    tests/unit/test_settings_bounds.py finds every numeric option and tries its edges."""

    def parse(text: str) -> int:
        try:
            return bounded_int("", text, low, high)
        except SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "int"
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    return parse


def seconds(low: float = MIN_TIMEOUT_S, high: float = MAX_TIMEOUT_S) -> Callable[[str], float]:
    """A type: a finite number of seconds in ``[low, high]`` (default: any timeout kvxfer takes, 1 ms to a
    day; ``kvxfer.defaults.MAX_TIMEOUT_S`` says why); ``bounds`` as ``whole_number``'s."""

    def parse(text: str) -> float:
        try:
            return bounded_float("", text, low, high, unit="a number of seconds")
        except SettingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "seconds"
    parse.bounds = (low, high)  # type: ignore[attr-defined]
    return parse


def writable_file(text: str) -> str:
    """A type: a path a file can be written to (its folder exists, or can be created, and is writable).

    Checked by trying, while the command line is read: a run writes its output only at its end,
    and a path found unwritable then has cost the whole run (``access()`` alone says yes to root
    under ``/proc`` or on a read-only mount). The try leaves nothing behind (``_try_writing``).
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory (give a file name, e.g. {path / 'out.json'})")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable (choose another path or fix its permissions)")
    folder = path.parent if str(path.parent) else Path(".")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {existing} is not a directory (choose another path)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {existing} is not writable (choose a writable folder)")
    why = _try_writing(path)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why} (choose another path)")
    return text


def _try_writing(path: Path) -> str:
    """Why ``path`` cannot be written ("" if it can), found by doing it: the missing folders made and
    the file created (an existing one opened to append, its bytes untouched), then whatever this
    made removed again, so a usage error found later leaves no trace."""
    missing = []
    folder = path.parent if str(path.parent) else Path(".")
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            made.append(path)
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for item in reversed(made):
            try:
                if item == path:
                    item.unlink()
                else:
                    item.rmdir()
            except OSError:
                pass
    return ""


def readable_file(text: str) -> str:
    """A type: an existing, readable regular file."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist (check the path)")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file (give a file path)")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable (fix its permissions)")
    return text


def executable_file(text: str) -> str:
    """A type: an existing executable (an interpreter, a tool)."""
    readable_file(text)
    if not os.access(text, os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not executable (give the path of a Python interpreter)")
    return text


def check_backend(name: str, *, must_run: bool = True, allow_push: Optional[bool] = None) -> str:
    """``name`` normalised, if it is a registered backend (and, with ``must_run``, can run here).

    Loopback, bench and generate drive push backends too (``PUSH_COMMANDS``); soak
    drives one-sided pulls, so there a push backend is refused by name rather than
    failing half-way through a run. ``allow_push`` None: decided by the command being parsed."""
    if allow_push is None:
        allow_push = _parsing_command.get() in PUSH_COMMANDS
    from kvxfer.backends import available_backends, normalize_name

    infos = {info.name: info for info in available_backends()}
    key = normalize_name(name)
    info = infos.get(key)
    if info is None:
        from kvxfer.backends import construct_kv_transfer_backend_class
        from kvxfer.errors import BackendUnavailableError

        try:  # a name kvxfer knows of but does not deliver says so in its own words
            construct_kv_transfer_backend_class(name)
        except BackendUnavailableError as exc:
            known = ", ".join(sorted(infos))
            if "unknown backend" in str(exc):
                raise argparse.ArgumentTypeError(
                    f"unknown backend {name!r} (choose one of: {known}; 'kvxfer info' shows which can run here)") from None
            raise argparse.ArgumentTypeError(f"{exc} (choose one of: {known})") from None
    if info is not None and info.is_push and not allow_push:
        pulls = ", ".join(sorted(n for n, i in infos.items() if not i.is_push))
        command = f"'kvxfer {_parsing_command.get()}'" if _parsing_command.get() else "this command"
        raise argparse.ArgumentTypeError(f"backend {key!r} is a push backend, and {command} drives pulls only "
                                         f"(choose one of: {pulls}; 'kvxfer loopback', 'kvxfer bench' and "
                                         f"'kvxfer generate' run {key!r})")
    if must_run and info is not None and not info.available:
        raise argparse.ArgumentTypeError(f"backend {key!r} cannot run here: {info.reason} "
                                         "(fix that, or choose another backend; see 'kvxfer info')")
    return key


def backend_name(text: str) -> str:
    """A type: a backend that is registered and can run on this machine."""
    return check_backend(text)


def backend_list(text: str) -> tuple[str, ...]:
    """A type: comma-separated backends, each registered and able to run here."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise argparse.ArgumentTypeError("no backend given (give e.g. nixl,ucx)")
    return tuple(check_backend(name) for name in names)


def add_common(parser: argparse.ArgumentParser, *, in_subcommand: bool) -> None:
    """``-v``, ``-q``, ``--debug``: accepted before or after the subcommand."""
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS if in_subcommand else 0,
                        help="more log output on stderr (-v: info, -vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS if in_subcommand else False,
                        help="only errors on stderr, no progress display")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS if in_subcommand else False,
                        help="show the traceback of an error (a child process's too)")


#: The numbers an etcd URL's query may carry, each read with its range (``kvxfer.defaults`` says why).
_URL_NUMBERS = (("ttl", bounded_int, ETCD_TTL_S, "a whole number of seconds"),
                ("poll", bounded_float, ETCD_POLL_S, "a number of seconds"),
                ("handoff_timeout", bounded_float, (MIN_TIMEOUT_S, MAX_TIMEOUT_S), "a number of seconds"))


def control_plane_url(text: str) -> str:
    """A type: an ``etcd://[user@]host:port[,host:port][/cluster][?ttl=S&poll=S&handoff_timeout=S]`` URL.

    ``etcd://`` with no endpoint is the demo mode of ``generate``: a private etcd is started.
    """
    from urllib.parse import parse_qs, urlsplit

    fix = "e.g. etcd://127.0.0.1:2379, or etcd:// to start a private etcd"
    if not text.startswith("etcd://"):
        raise argparse.ArgumentTypeError(f"control plane {text!r} is not an etcd:// URL ({fix})")
    try:
        parts = urlsplit(text)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if ":" in userinfo:
            raise ValueError("put the etcd password in a file ($KVXFER_ETCD_PASSWORD_FILE), not in the URL")
        for host in filter(None, hosts.split(",")):
            name, sep, port = host.rpartition(":")
            if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"endpoint {host!r} is not host:port")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        for key, read, (low, high), unit in _URL_NUMBERS:
            if key in query:
                read(key, query[key], low, high, unit=unit)
        from engine_integration.control_plane.etcd.records import KeyLayout
        from engine_integration.control_plane.etcd.store import parse_etcd_url

        config = parse_etcd_url(text if hosts else text.replace("etcd://", "etcd://127.0.0.1:2379", 1))
        KeyLayout(config.cluster)
    except SettingError as exc:  # names the number and its range: the fix is in it
        raise argparse.ArgumentTypeError(f"control plane URL {text!r}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"control plane URL {text!r}: {exc} ({fix})") from None
    return text
