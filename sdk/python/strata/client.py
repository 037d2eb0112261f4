"""The clients: :class:`AsyncClient` (asyncio, on ``grpc.aio``) and :class:`Client`, the
same API for synchronous scripts (it drives an :class:`AsyncClient` on a private event
loop thread)."""

from __future__ import annotations

import asyncio
import codecs
import os
import threading
from dataclasses import dataclass
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    TypeVar,
    Union,
)

import grpc

from .errors import StrataError, from_rpc
from .v1 import catalog_pb2, catalog_pb2_grpc, node_pb2, node_pb2_grpc
from .v1 import sandboxes_pb2 as pb
from .v1 import sandboxes_pb2_grpc

T = TypeVar("T")
Command = Union[str, Sequence[str]]

#: How much of a file one WriteFile message carries.
_WRITE_PART = 1 << 20


def _argv(cmd: Command) -> List[str]:
    """A string runs through ``/bin/sh -c``; a list is the argv itself."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv:
        raise ValueError("empty command")
    return argv


def _target(url: str) -> str:
    for prefix in ("http://", "grpc://"):
        if url.startswith(prefix):
            return url[len(prefix) :].rstrip("/")
    if url.startswith("https://"):
        raise ValueError("TLS endpoints are not supported yet; use http://HOST:PORT")
    return url


def _secs(value: Union[None, str, int, float]) -> str:
    """A duration for the service: ``"5m"``, or a number of seconds."""
    if value is None:
        return ""
    if isinstance(value, (int, float)):
        return f"{float(value):g}s"
    return str(value)


@dataclass
class ExecResult:
    """What a command returned. ``stdout``/``stderr`` are decoded (UTF-8, bad bytes
    replaced); ``stdout_raw``/``stderr_raw`` are the bytes. ``truncated`` is set when a
    stream printed more than the service keeps (16 MiB by default); ``budget`` names the
    budget that ended the command (``"memory"``, ``"pids"``, ``"disk"``, ``"timeout"``)."""

    exit_code: int
    stdout_raw: bytes
    stderr_raw: bytes
    truncated: bool
    budget: Optional[str]
    budgets_hit: List[str]
    stdout_bytes: int
    stderr_bytes: int
    duration_ms: int
    signal: Optional[int]
    #: The journal's recorded result of a step that ran before (the command did not run now).
    replayed: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_raw.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_raw.decode("utf-8", "replace")

    @classmethod
    def _from(cls, r: pb.ExecReply) -> "ExecResult":
        return cls(
            exit_code=r.exit_code,
            stdout_raw=bytes(r.stdout),
            stderr_raw=bytes(r.stderr),
            truncated=r.truncated,
            budget=r.budget or None,
            budgets_hit=list(r.budgets_hit),
            stdout_bytes=r.stdout_bytes,
            stderr_bytes=r.stderr_bytes,
            duration_ms=r.duration_ms,
            signal=r.signal if r.has_signal else None,
            replayed=r.replayed,
        )


@dataclass
class ExecEvent:
    """One event of a streaming exec: some output (``stdout`` or ``stderr`` text, ``data``
    its bytes) or, last, the end (``exit_code`` and ``result`` set)."""

    stdout: Optional[str] = None
    stderr: Optional[str] = None
    data: bytes = b""
    exit_code: Optional[int] = None
    result: Optional[ExecResult] = None


@dataclass
class FileEntry:
    name: str
    size: int
    is_dir: bool
    mode: int
    kind: str


@dataclass
class Process:
    pid: int
    state: str
    rss_bytes: int
    cmdline: str


def _metadata(token: Optional[str]):
    return (("authorization", f"Bearer {token}"),) if token else ()


class AsyncClient:
    """A connection to a Strata node service.

    ``url`` is ``http://HOST:PORT`` (default ``STRATA_SERVER`` or
    ``http://127.0.0.1:7600``); ``token`` a project's token (default ``STRATA_TOKEN``).
    ``timeout`` bounds each call that is not a command (seconds).
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        timeout: Optional[float] = 600.0,
    ) -> None:
        self.url = url or os.environ.get("STRATA_SERVER") or "http://127.0.0.1:7600"
        self._token = token if token is not None else os.environ.get("STRATA_TOKEN")
        self._timeout = timeout
        self._channel = grpc.aio.insecure_channel(
            _target(self.url),
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        self._md = _metadata(self._token)
        self._sandboxes = sandboxes_pb2_grpc.SandboxesStub(self._channel)
        self._node = node_pb2_grpc.NodeStub(self._channel)
        self._catalog = catalog_pb2_grpc.CatalogStub(self._channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, fn: Callable[..., Awaitable[T]], req: Any, timeout: Optional[float] = None) -> T:
        try:
            return await fn(req, metadata=self._md, timeout=timeout if timeout is not None else self._timeout)
        except grpc.RpcError as e:
            raise from_rpc(e) from None

    # -- sandboxes -------------------------------------------------------------------

    async def create(
        self,
        catalog_id: str,
        *,
        backend: Optional[str] = None,
        memory: Optional[str] = None,
        cpus: Optional[float] = None,
        disk: Optional[str] = None,
        pids: Optional[int] = None,
        timeout: Union[None, str, float] = None,
        idle_ttl: Union[None, str, float] = None,
        lifetime: Union[None, str, float] = None,
        auto_hibernate: Union[None, str, float] = None,
        env: Optional[Mapping[str, str]] = None,
        network: Optional[Sequence[str]] = None,
        labels: Optional[Mapping[str, str]] = None,
    ) -> "AsyncSandbox":
        """A new sandbox of catalog entry ``catalog_id`` (``namespace/name[@version]``).

        Budgets left out are the entry's. ``timeout`` is the per-command wall clock,
        ``idle_ttl`` the idle time after which the node destroys it, ``lifetime`` its
        longest life, ``auto_hibernate`` the idle time after which a microvm or vm
        hibernates (its next call wakes it). ``network`` lists allowed ``HOST:PORT`` destinations (``[]``: none;
        ``None``: the entry's). Raises :class:`QuotaExceeded` when the project or the node
        is full.
        """
        req = pb.CreateRequest(
            catalog_id=catalog_id,
            backend=backend or "",
            budgets=pb.Budgets(
                memory=memory or "",
                cpus=float(cpus or 0),
                disk=disk or "",
                pids=int(pids or 0),
                timeout=_secs(timeout),
            ),
            env=dict(env or {}),
            network=list(network or []),
            network_set=network is not None,
            idle_ttl=_secs(idle_ttl),
            lifetime=_secs(lifetime),
            auto_hibernate=_secs(auto_hibernate),
            labels=dict(labels or {}),
        )
        info = await self._call(self._sandboxes.Create, req)
        return AsyncSandbox(self, info)

    async def get(self, sandbox_id: str) -> "AsyncSandbox":
        """The caller's sandbox ``sandbox_id``; :class:`NotFound` if it is not one."""
        info = await self._call(self._sandboxes.Get, pb.SandboxRef(id=sandbox_id))
        return AsyncSandbox(self, info)

    async def list(self, labels: Optional[Mapping[str, str]] = None) -> List["AsyncSandbox"]:
        """The project's sandboxes on this node whose labels include ``labels``."""
        r = await self._call(self._sandboxes.List, pb.ListRequest(labels=dict(labels or {})))
        return [AsyncSandbox(self, i) for i in r.sandboxes]

    async def restore(
        self,
        snapshot_id: str,
        *,
        lifetime: Union[None, str, float] = None,
        labels: Optional[Mapping[str, str]] = None,
    ) -> "AsyncSandbox":
        """A new sandbox from the project's snapshot ``snapshot_id`` (``snap-...``, from
        :meth:`AsyncSandbox.snapshot`), on this node, wherever it was taken: a microvm's or
        vm's continues its processes and memory, a container's or fncall's has its files."""
        info = await self._call(
            self._sandboxes.Restore,
            pb.RestoreRequest(
                snapshot=snapshot_id, lifetime=_secs(lifetime), labels=dict(labels or {})
            ),
        )
        return AsyncSandbox(self, info)

    async def snapshots(self) -> List["pb.SnapshotInfo"]:
        """The project's snapshots in the store, oldest first."""
        r = await self._call(self._sandboxes.ListSnapshots, pb.ListSnapshotsRequest())
        return list(r.snapshots)

    async def remove_snapshot(self, snapshot_id: str) -> None:
        await self._call(self._sandboxes.RemoveSnapshot, pb.SnapshotId(id=snapshot_id))

    # -- node and catalog ------------------------------------------------------------

    async def hibernate(self, labels: Mapping[str, str]) -> "pb.HibernateReply":
        """Hibernates every sandbox of the project whose labels include all of ``labels``
        (a training job's, at preemption), in parallel. Each entry of ``sandboxes`` has its
        ``id``, ``state_bytes`` and ``ms``, or ``error``."""
        return await self._call(
            self._sandboxes.Hibernate, pb.HibernateRequest(labels=dict(labels))
        )

    async def health(self) -> str:
        r = await self._call(self._node.Health, node_pb2.HealthRequest())
        return r.status

    async def capacity(self) -> node_pb2.CapacityReply:
        return await self._call(self._node.Capacity, node_pb2.CapacityRequest())

    async def register(self, toml: str, catalog_id: str = "") -> str:
        """Registers a catalog entry (its TOML) in one of the project's namespaces;
        returns its reference (``namespace/name@version``)."""
        r = await self._call(
            self._catalog.Register, catalog_pb2.RegisterRequest(catalog_id=catalog_id, toml=toml)
        )
        return r.reference

    async def resolve(self, catalog_id: str) -> catalog_pb2.CatalogEntry:
        return await self._call(self._catalog.Resolve, catalog_pb2.CatalogRef(catalog_id=catalog_id))


class AsyncFiles:
    """Files of one sandbox. Paths are absolute inside it."""

    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def read(self, path: str) -> bytes:
        c = self._sb._client
        try:
            call = c._sandboxes.ReadFile(pb.FileRef(id=self._sb.id, path=path), metadata=c._md, timeout=c._timeout)
            parts = [bytes(m.data) async for m in call]
        except grpc.RpcError as e:
            raise from_rpc(e) from None
        return b"".join(parts)

    async def write(self, path: str, data: Union[bytes, str], mode: int = 0o644) -> int:
        """Writes ``data`` (``str`` as UTF-8) to ``path``, making missing parents."""
        if isinstance(data, str):
            data = data.encode()
        sid = self._sb.id

        async def chunks():
            yield pb.WriteChunk(id=sid, path=path, mode=mode, data=data[:_WRITE_PART])
            for off in range(_WRITE_PART, len(data), _WRITE_PART):
                yield pb.WriteChunk(data=data[off : off + _WRITE_PART])

        c = self._sb._client
        r = await c._call(c._sandboxes.WriteFile, chunks())
        return r.bytes

    async def list(self, path: str) -> List[FileEntry]:
        c = self._sb._client
        r = await c._call(c._sandboxes.ListDir, pb.FileRef(id=self._sb.id, path=path))
        return [FileEntry(e.name, e.size, e.is_dir, e.mode, e.kind) for e in r.entries]

    async def stat(self, path: str) -> FileEntry:
        c = self._sb._client
        e = await c._call(c._sandboxes.Stat, pb.FileRef(id=self._sb.id, path=path))
        return FileEntry(e.name, e.size, e.is_dir, e.mode, e.kind)

    async def remove(self, path: str, recursive: bool = False) -> None:
        c = self._sb._client
        await c._call(c._sandboxes.Remove, pb.RemoveRequest(id=self._sb.id, path=path, recursive=recursive))

    async def make_dir(self, path: str, parents: bool = True) -> None:
        c = self._sb._client
        await c._call(c._sandboxes.MakeDir, pb.MakeDirRequest(id=self._sb.id, path=path, parents=parents))


class AsyncSandbox:
    """One sandbox. ``async with sb:`` destroys it on exit."""

    def __init__(self, client: AsyncClient, info: pb.SandboxInfo) -> None:
        self._client = client
        self._info = info
        self.files = AsyncFiles(self)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.backend} {self.state}>"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.destroy()

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def state(self) -> str:
        """``running`` or ``paused`` (as of the last call that returned it)."""
        return self._info.state

    @property
    def labels(self) -> Dict[str, str]:
        return dict(self._info.labels)

    @property
    def backend(self) -> str:
        return self._info.backend

    @property
    def catalog_ref(self) -> str:
        return self._info.catalog_ref

    @property
    def info(self) -> pb.SandboxInfo:
        return self._info

    def _ref(self) -> pb.SandboxRef:
        return pb.SandboxRef(id=self.id)

    async def refresh(self) -> "AsyncSandbox":
        self._info = await self._client._call(self._client._sandboxes.Get, self._ref())
        return self

    async def exec(
        self,
        cmd: Optional[Command],
        *,
        timeout: Union[None, str, float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[None, bytes, str] = None,
        step_id: Optional[str] = None,
    ) -> ExecResult:
        """Runs ``cmd`` to its end (a ``str`` through ``/bin/sh -c``, a list as argv).

        With ``step_id`` ("turn-12") the exec is a step of the sandbox's journal: asked
        again (after a lost connection, a restarted trainer), a finished step returns its
        recorded result (``replayed`` set) without running again, a running one is waited
        for, one cut off by a node restart raises :class:`FailedPrecondition`. ``cmd=None``
        with a ``step_id`` only looks the step up."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        req = pb.ExecRequest(
            id=self.id,
            argv=[] if cmd is None else _argv(cmd),
            env=dict(env or {}),
            cwd=cwd or "",
            timeout=_secs(timeout),
            stdin=stdin or b"",
            step_id=step_id or "",
        )
        # The command's own limit bounds it; the call waits for it.
        r = await self._client._call(self._client._sandboxes.Exec, req, timeout=None if timeout is None else float(_to_seconds(timeout)) + 60)
        return ExecResult._from(r)

    async def exec_stream(
        self,
        cmd: Optional[Command],
        *,
        timeout: Union[None, str, float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[None, bytes, str, AsyncIterator[bytes]] = None,
        step_id: Optional[str] = None,
    ) -> AsyncIterator[ExecEvent]:
        """Runs ``cmd``, yielding its output as it is printed, then its end. ``stdin`` may
        be bytes or an async iterator of bytes (the command's stdin ends with it).
        ``step_id`` as for :meth:`exec` (a replayed step yields its recorded output)."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        req = pb.ExecRequest(
            id=self.id,
            argv=[] if cmd is None else _argv(cmd),
            env=dict(env or {}),
            cwd=cwd or "",
            timeout=_secs(timeout),
            step_id=step_id or "",
        )

        async def inputs():
            first = pb.ExecInput(request=req)
            if isinstance(stdin, (bytes, bytearray)):
                first.stdin = bytes(stdin)
            yield first
            if stdin is not None and not isinstance(stdin, (bytes, bytearray)):
                async for part in stdin:
                    yield pb.ExecInput(stdin=bytes(part))
            yield pb.ExecInput(close_stdin=True)

        c = self._client
        dec = {"out": codecs.getincrementaldecoder("utf-8")("replace"), "err": codecs.getincrementaldecoder("utf-8")("replace")}
        try:
            call = c._sandboxes.ExecStream(inputs(), metadata=c._md)
            async for ev in call:
                kind = ev.WhichOneof("event")
                if kind == "stdout":
                    yield ExecEvent(stdout=dec["out"].decode(ev.stdout), data=bytes(ev.stdout))
                elif kind == "stderr":
                    yield ExecEvent(stderr=dec["err"].decode(ev.stderr), data=bytes(ev.stderr))
                elif kind == "exit":
                    res = ExecResult._from(ev.exit)
                    yield ExecEvent(exit_code=res.exit_code, result=res)
        except grpc.RpcError as e:
            raise from_rpc(e) from None

    async def processes(self) -> List[Process]:
        r = await self._client._call(self._client._sandboxes.Processes, self._ref())
        return [Process(p.pid, p.state, p.rss_bytes, p.cmdline) for p in r.processes]

    async def pause(self) -> None:
        self._info = await self._client._call(self._client._sandboxes.Pause, self._ref())

    async def hibernate(self) -> "pb.Hibernated":
        """Saves the sandbox's whole state to disk and stops it (microvm, vm): its memory
        and CPUs go back to the node. The next call on it wakes it where it was (or
        :meth:`wake`). The reply has ``state_bytes`` and ``ms``."""
        r = await self._client._call(
            self._client._sandboxes.Hibernate, pb.HibernateRequest(ids=[self.id])
        )
        done = r.sandboxes[0]
        if done.error:
            from .errors import InvalidArgument

            raise InvalidArgument(done.error, reason="invalid-argument")
        await self.refresh()
        return done

    async def fork(self, count: int = 1) -> List["AsyncSandbox"]:
        """``count`` (1-100) new sandboxes that start from where this one is: a microvm's
        or vm's continue its processes and memory with a fresh identity; a container's or
        fncall's get its files."""
        r = await self._client._call(
            self._client._sandboxes.Fork, pb.ForkRequest(id=self.id, count=count)
        )
        return [AsyncSandbox(self._client, info) for info in r.children]

    async def wake(self) -> None:
        """Starts a hibernated sandbox again where it was (any call on it does too)."""
        self._info = await self._client._call(self._client._sandboxes.Wake, self._ref())

    async def resume(self) -> None:
        self._info = await self._client._call(self._client._sandboxes.Resume, self._ref())

    async def extend(
        self, *, idle_ttl: Union[None, str, float] = None, lifetime: Union[None, str, float] = None
    ) -> None:
        """Sets a new idle TTL and/or a lifetime counted from now."""
        self._info = await self._client._call(
            self._client._sandboxes.Extend,
            pb.ExtendRequest(id=self.id, idle_ttl=_secs(idle_ttl), lifetime=_secs(lifetime)),
        )

    async def set_network(self, network: Sequence[str]) -> None:
        """Replaces the allowed ``HOST:PORT`` destinations while the sandbox runs
        (``[]``: nothing but its own loopback). Container and fncall sandboxes."""
        self._info = await self._client._call(
            self._client._sandboxes.SetNetwork,
            pb.SetNetworkRequest(id=self.id, network=list(network)),
        )

    async def commit(self, kind: str = "workspace", register: Optional[str] = None) -> "pb.CommitReply":
        """Makes what the sandbox changed over its layers a new layer in the store; with
        ``register="namespace/name"`` also a catalog entry (the sandbox's entry with the
        layer on top). The reply has ``layer`` (its ID) and ``registered``
        (``namespace/name@version``, empty when none). The sandbox runs on."""
        return await self._client._call(
            self._client._sandboxes.Commit,
            pb.CommitRequest(id=self.id, kind=kind, register=register or ""),
        )

    async def evaluate(self, command: str, *, backend: Optional[str] = None) -> "pb.EvaluateReply":
        """Grades the sandbox: its catalog entry's command ``command`` runs in a fresh
        sandbox of the entry's stack with this sandbox's changes on top, the entry's
        protected paths and evaluator files mounted read-only (``[evaluator]`` in the
        entry); what this sandbox changed under them is dropped first. This sandbox is left
        as it is. The reply has ``exit_code``, ``stdout``, ``stderr`` (bytes),
        ``truncated``, ``budget``, ``layer`` (its changes), ``changed`` (paths, each with
        ``change`` and ``protected``) and ``changed_total``."""
        return await self._client._call(
            self._client._sandboxes.Evaluate,
            pb.EvaluateRequest(id=self.id, command=command, backend=backend or ""),
        )

    async def snapshot(self, name: Optional[str] = None, *, files_only: bool = False) -> "pb.SnapshotInfo":
        """Saves the sandbox into the store as a snapshot any node sharing the store
        restores (:meth:`AsyncClient.restore`): a microvm's or vm's processes, memory and
        files; a container's or fncall's files (``files_only``: the files of any). The
        sandbox runs on. The reply has ``id``
        (``snap-...``), ``memory`` and the sizes."""
        r = await self._client._call(
            self._client._sandboxes.Snapshot,
            pb.SnapshotRequest(
                id=self.id, to_store=True, names=[name] if name else [], files_only=files_only
            ),
        )
        return r.snapshot

    async def journal(self) -> List["pb.JournalStep"]:
        """The steps of the sandbox's command journal (execs given a ``step_id``), oldest
        first: ``step_id``, ``argv``, ``state`` (running, done, failed, interrupted),
        ``result`` (exit and sizes; repeat a step to read its output). Also after the
        sandbox is gone, for the node's journal retention."""
        r = await self._client._call(self._client._sandboxes.Journal, self._ref())
        return list(r.steps)

    async def audit(self) -> str:
        """The sandbox's audit record, JSON lines (also after it is gone)."""
        r = await self._client._call(self._client._sandboxes.Audit, self._ref())
        return r.jsonl

    async def destroy(self) -> None:
        """Ends the sandbox; one already gone counts as destroyed."""
        from .errors import NotFound

        try:
            await self._client._call(self._client._sandboxes.Destroy, self._ref())
        except NotFound:
            pass


def _to_seconds(value: Union[str, float]) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    text = value.strip()
    for u in ("ms", "s", "m", "h", "d"):
        if text.endswith(u):
            try:
                return float(text[: -len(u)]) * units[u]
            except ValueError:
                break
    return 3600.0


# -- the synchronous API ------------------------------------------------------------


class _Loop:
    """An event loop on its own thread, for the synchronous wrappers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="strata-client", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self.run(agen.__anext__())
            except StopAsyncIteration:
                return

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class Files:
    """The synchronous :class:`AsyncFiles`."""

    def __init__(self, loop: _Loop, files: AsyncFiles) -> None:
        self._loop, self._f = loop, files

    def read(self, path: str) -> bytes:
        return self._loop.run(self._f.read(path))

    def write(self, path: str, data: Union[bytes, str], mode: int = 0o644) -> int:
        return self._loop.run(self._f.write(path, data, mode))

    def list(self, path: str) -> List[FileEntry]:
        return self._loop.run(self._f.list(path))

    def stat(self, path: str) -> FileEntry:
        return self._loop.run(self._f.stat(path))

    def remove(self, path: str, recursive: bool = False) -> None:
        self._loop.run(self._f.remove(path, recursive))

    def make_dir(self, path: str, parents: bool = True) -> None:
        self._loop.run(self._f.make_dir(path, parents))


class Sandbox:
    """The synchronous :class:`AsyncSandbox`; ``with sb:`` destroys it on exit."""

    def __init__(self, loop: _Loop, sb: AsyncSandbox) -> None:
        self._loop, self._sb = loop, sb
        self.files = Files(loop, sb.files)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.backend} {self.state}>"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    id = property(lambda self: self._sb.id)
    state = property(lambda self: self._sb.state)
    labels = property(lambda self: self._sb.labels)
    backend = property(lambda self: self._sb.backend)
    catalog_ref = property(lambda self: self._sb.catalog_ref)
    info = property(lambda self: self._sb.info)

    def exec(self, cmd: Command, **kw: Any) -> ExecResult:
        return self._loop.run(self._sb.exec(cmd, **kw))

    def exec_stream(self, cmd: Command, **kw: Any) -> Iterator[ExecEvent]:
        return self._loop.iterate(self._sb.exec_stream(cmd, **kw))

    def processes(self) -> List[Process]:
        return self._loop.run(self._sb.processes())

    def refresh(self) -> "Sandbox":
        self._loop.run(self._sb.refresh())
        return self

    def pause(self) -> None:
        self._loop.run(self._sb.pause())

    def hibernate(self) -> "pb.Hibernated":
        return self._loop.run(self._sb.hibernate())

    def wake(self) -> None:
        self._loop.run(self._sb.wake())

    def fork(self, count: int = 1) -> List["Sandbox"]:
        return [Sandbox(self._loop, sb) for sb in self._loop.run(self._sb.fork(count))]

    def resume(self) -> None:
        self._loop.run(self._sb.resume())

    def extend(self, **kw: Any) -> None:
        self._loop.run(self._sb.extend(**kw))

    def set_network(self, network: Sequence[str]) -> None:
        self._loop.run(self._sb.set_network(network))

    def commit(self, kind: str = "workspace", register: Optional[str] = None) -> "pb.CommitReply":
        return self._loop.run(self._sb.commit(kind, register))

    def evaluate(self, command: str, *, backend: Optional[str] = None) -> "pb.EvaluateReply":
        return self._loop.run(self._sb.evaluate(command, backend=backend))

    def snapshot(self, name: Optional[str] = None, *, files_only: bool = False) -> "pb.SnapshotInfo":
        return self._loop.run(self._sb.snapshot(name, files_only=files_only))

    def journal(self) -> List["pb.JournalStep"]:
        return self._loop.run(self._sb.journal())

    def audit(self) -> str:
        return self._loop.run(self._sb.audit())

    def destroy(self) -> None:
        self._loop.run(self._sb.destroy())


class Client:
    """The synchronous :class:`AsyncClient`, for scripts: the same methods, blocking."""

    def __init__(self, url: Optional[str] = None, token: Optional[str] = None, **kw: Any) -> None:
        self._loop = _Loop()

        async def make() -> AsyncClient:
            return AsyncClient(url, token, **kw)

        self._c = self._loop.run(make())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._loop.run(self._c.close())
        self._loop.stop()

    def create(self, catalog_id: str, **kw: Any) -> Sandbox:
        return Sandbox(self._loop, self._loop.run(self._c.create(catalog_id, **kw)))

    def get(self, sandbox_id: str) -> Sandbox:
        return Sandbox(self._loop, self._loop.run(self._c.get(sandbox_id)))

    def list(self, labels: Optional[Mapping[str, str]] = None) -> List[Sandbox]:
        return [Sandbox(self._loop, s) for s in self._loop.run(self._c.list(labels))]

    def hibernate(self, labels: Mapping[str, str]) -> "pb.HibernateReply":
        return self._loop.run(self._c.hibernate(labels))

    def restore(self, snapshot_id: str, **kw: Any) -> Sandbox:
        return Sandbox(self._loop, self._loop.run(self._c.restore(snapshot_id, **kw)))

    def snapshots(self) -> List["pb.SnapshotInfo"]:
        return self._loop.run(self._c.snapshots())

    def remove_snapshot(self, snapshot_id: str) -> None:
        self._loop.run(self._c.remove_snapshot(snapshot_id))

    def health(self) -> str:
        return self._loop.run(self._c.health())

    def capacity(self) -> node_pb2.CapacityReply:
        return self._loop.run(self._c.capacity())

    def register(self, toml: str, catalog_id: str = "") -> str:
        return self._loop.run(self._c.register(toml, catalog_id))

    def resolve(self, catalog_id: str) -> catalog_pb2.CatalogEntry:
        return self._loop.run(self._c.resolve(catalog_id))
