"""One streamed GET of a receive, with a whole-request deadline and cancellation, that maps
every failure to the errors a receive raises."""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

from torchft.checkpointing import _serialization as ser
from torchft.checkpointing._security import CheckpointAuthError, describe_tls_failure
from torchft.checkpointing.http.wire import Aborted

_MAX_ERROR_BODY = 64 << 10


@dataclass(frozen=True)
class FetchOpts:
    """How fetches reach a checkpoint server: TLS context (None: plain) and headers."""

    tls: ssl.SSLContext | None
    headers: dict[str, str]


class Fetch:
    """One streamed GET with a whole-request deadline and optional cancellation."""

    def __init__(
        self,
        base: urllib.parse.SplitResult,
        path: str,
        deadline: float,
        src: int,
        opts: FetchOpts,
        cancel: threading.Event | None = None,
    ) -> None:
        self._opts = opts
        self._base = base
        self._path = path
        self._deadline = deadline
        self._src = src
        self._cancel = cancel
        self._conn: http.client.HTTPConnection | None = None
        self._sock: socket.socket | None = None
        self._resp: http.client.HTTPResponse | None = None
        self.url = f"{base.scheme}://{base.netloc}{path}"

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"timed out fetching checkpoint from replica {self._src} ({self.url})"
            )
        return remaining

    def check(self) -> None:
        """Raises if the deadline passed or the fetch was cancelled."""
        if self._cancel is not None and self._cancel.is_set():
            raise Aborted("cancelled")
        self._sock_timeout()

    def _sock_timeout(self) -> None:
        remaining = self._remaining()
        if self._sock is not None:
            self._sock.settimeout(remaining)

    def _cannot_fetch(self, e: BaseException) -> ConnectionError:
        return ConnectionError(
            f"could not fetch checkpoint from replica {self._src} ({self.url}): {e!r}"
        )

    def __enter__(self) -> Fetch:
        assert self._base.hostname is not None
        conn: http.client.HTTPConnection
        if self._base.scheme == "https":
            conn = http.client.HTTPSConnection(
                self._base.hostname,
                self._base.port,
                timeout=self._remaining(),
                context=self._opts.tls,
            )
        else:
            conn = http.client.HTTPConnection(
                self._base.hostname, self._base.port, timeout=self._remaining()
            )
        self._conn = conn
        try:
            conn.connect()
            self._sock = conn.sock
            if self._cancel is not None and self._cancel.is_set():
                raise Aborted("cancelled")
            conn.putrequest("GET", self._path)
            for name, value in self._opts.headers.items():
                conn.putheader(name, value)
            conn.endheaders()
            self._sock_timeout()
            resp = conn.getresponse()
        except TimeoutError:
            self.__exit__(None, None, None)
            raise TimeoutError(
                f"timed out fetching checkpoint from replica {self._src} ({self.url})"
            ) from None
        except ssl.SSLError as e:
            self.__exit__(None, None, None)
            raise ConnectionError(describe_tls_failure(e, self.url)) from e
        except (ConnectionResetError, http.client.RemoteDisconnected) as e:
            self.__exit__(None, None, None)
            if self._base.scheme == "https":
                raise ConnectionError(describe_tls_failure(e, self.url)) from e
            raise self._cannot_fetch(e) from e
        except (OSError, http.client.HTTPException) as e:
            self.__exit__(None, None, None)
            raise self._cannot_fetch(e) from e
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self._resp = resp
        if resp.status != 200:
            try:
                msg = resp.read(_MAX_ERROR_BODY).decode(errors="replace")
            except (OSError, http.client.HTTPException):
                msg = ""
            self.__exit__(None, None, None)
            if resp.status == 401:
                raise CheckpointAuthError(
                    f"replica {self._src}'s checkpoint server refused the token: {msg.strip()}"
                )
            if resp.status == 503:
                raise TimeoutError(
                    f"replica {self._src} did not serve the checkpoint in time: {msg}"
                )
            raise RuntimeError(
                f"checkpoint request to replica {self._src} failed (HTTP {resp.status}): {msg}"
            )
        return self

    def readinto(self, buf: memoryview) -> int:
        """Reads into ``buf`` (``file.readinto`` semantics), mapping stream errors."""
        assert self._resp is not None
        try:
            return self._resp.readinto(buf)
        except http.client.IncompleteRead as e:
            raise ser.CheckpointFormatError(
                f"checkpoint stream from {self.url} truncated: {e!r}"
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"timed out reading checkpoint from replica {self._src} ({self.url})"
            ) from None
        except (ConnectionError, http.client.HTTPException) as e:
            if self._cancel is not None and self._cancel.is_set():
                raise Aborted("cancelled") from None
            raise ser.CheckpointFormatError(
                f"checkpoint stream from {self.url} broke: {e!r}"
            ) from None

    def expect_eof(self) -> None:
        """Raises if the server sent more bytes than the frames describe."""
        if self.readinto(memoryview(bytearray(1))) != 0:
            raise ser.CheckpointFormatError(f"unexpected trailing bytes from {self.url}")

    def abort(self) -> None:
        """Breaks the connection so a blocked read returns at once."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __exit__(self, *exc: object) -> None:
        if self._resp is not None:
            with contextlib.suppress(Exception):
                self._resp.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
