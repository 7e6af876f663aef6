"""Stalls: a NATS server or a process that stops answering with its sockets open (SIGSTOP),
the gray failure a crash test never shows (docs/fault-tolerance.md, "Stalls"): the only
server, a worker host, the processes and the members of a queue group here; a cluster node:
tests/test_stalls_nodes.py; a stream's leader: tests/test_stalls_leaders.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bus_schemas import codec, subjects
from bus_schemas import errors as E
from bus_schemas import headers as H
from services import caller, members, runtime
from services.runtime import connect
from services.supervisor import Child, Supervisor
from tests import netns
from tests.support.inprocess import stack
from tests.support.natsserver import NatsServer, spawn_nats
from tests.support.pids import child_matching, stop_process
from tests.support.ports import free_port
from tests.support.procs import Procs, start_stack
from tests.support.waits import wait_for, wait_replicas
from tokenbus import Client

PROMPT: Any = [{"role": "user", "content": "a stall"}]
# Sim workers that stream at a pace a fault can land in the middle of.
SIM_PACE = ("--sim-prefill-ms", "5", "--sim-decode-ms", "20")


def pause(pids: list[int], pid: int) -> None:
    pids.append(pid)
    os.kill(pid, signal.SIGSTOP)


async def _stream_text(
    oai: openai.AsyncOpenAI, model: str, gaps: list[float], max_tokens: int = 40
) -> str:
    """One streamed answer's text; the longest wait between two of its chunks in ``gaps``."""
    stream: Any = await oai.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=max_tokens, stream=True, timeout=60
    )
    parts, last, gap = [], time.monotonic(), 0.0
    async for c in stream:
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
    gaps.append(gap)
    return "".join(parts)


class _Load:
    """``clients`` closed-loop streaming HTTP clients until :meth:`stop`: the outcomes
    (``ok``: the whole answer, ``want``), the errors' text, and each answer's longest wait
    between two chunks."""

    def __init__(
        self,
        oai: openai.AsyncOpenAI,
        model: str,
        want: str | None,
        clients: int,
        max_tokens: int = 40,
    ) -> None:
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self.gaps: list[float] = []
        self._stopping = asyncio.Event()

        async def client() -> None:
            while not self._stopping.is_set():
                try:
                    text = await _stream_text(oai, model, self.gaps, max_tokens)
                except openai.APIError as exc:
                    self.outcomes[getattr(exc, "code", None) or "error"] += 1
                    self.errors.append(repr(exc)[:300])
                    continue
                self.outcomes["ok" if text == want else "wrong_text"] += 1
                if text != want:
                    self.errors.append(f"wrong text: {text!r} (want {want!r})")

        self._task = asyncio.gather(*(client() for _ in range(clients)))

    async def served(self, more: int, what: str) -> None:
        """Until ``more`` answers have come whole and right from now (bounded)."""
        target = self.outcomes["ok"] + more
        await wait_for(lambda: self.outcomes["ok"] >= target, timeout=60, what=what)

    async def stop(self) -> None:
        self._stopping.set()
        await self._task


async def _post_now(
    port: int | None, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A chat completion POSTed to the bridge on a connection of its own: its bytes are
    written to the socket when this returns (read the answer with :func:`_answer`; the
    writer is kept, or the connection closes with it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bridge\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    return reader, writer


async def _answer(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> tuple[int, Any]:
    """The status and JSON body of the answer on ``conn`` (read to the end), then closed."""
    reader, writer = conn
    try:
        raw = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.fault
async def test_streams_ride_out_a_paused_nats_server(
    tmp_path: Path, model: str, paused: list[int]
) -> None:
    """The only nats-server of the stack paused under streaming HTTP load until its
    connections have taken it for gone (2 to 3 s): no stream is cut and every answer is
    whole and right; a request sent while the bridge's connection was down is served once
    the pause ends."""
    srv = NatsServer(tmp_path / "nats").start()
    try:
        with Procs(srv.url, tmp_path) as procs:
            stack = await start_stack(
                procs,
                model,
                "ingress",
                "router",
                workers=2,
                worker_args=SIM_PACE,
            )
            async with stack.openai() as oai:
                ref = await oai.chat.completions.create(
                    model=model,
                    messages=PROMPT,
                    max_tokens=40,
                )
                want = ref.choices[0].message.content
                load = _Load(oai, model, want, 4)
                await load.served(4, "the load did not start")
                assert srv.proc is not None
                pause(paused, srv.proc.pid)
                # Once the bridge has taken the server for gone (its pings unanswered):
                await wait_for(
                    lambda: "nats_disconnected" in stack.bridge.output(),
                    timeout=20,
                    what="the bridge did not notice the paused server",
                )
                # A request whose bytes are with the bridge while its connection is down.
                body = {"model": model, "messages": PROMPT, "max_tokens": 40}
                late = await _post_now(stack.port, body)
                os.kill(srv.proc.pid, signal.SIGCONT)
                await load.served(8, "the load was not served after the pause")
                await load.stop()
                # The request made while the connection was down waited for it, not a 503.
                status, answer = await _answer(late)
                assert status == 200 and answer["choices"][0]["message"]["content"] == want
            outcomes = load.outcomes
            print(f"\nnats-server paused under load: {dict(outcomes)}")
            assert outcomes["ok"] > 8 and outcomes["ok"] == sum(outcomes.values()), (
                outcomes,
                load.errors[:3],
            )
            assert procs.all_alive()
    finally:
        srv.stop()


class _NatsLoad(_Load):
    """``tokenbus.Client`` streams over NATS, one closed loop per connection in ``tbs``
    (each logged in with its key), until :meth:`stop`; the outcomes as :class:`_Load`'s."""

    def __init__(self, tbs: list[Client], model: str, want: str | None) -> None:
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stopping = asyncio.Event()

        async def client(tb: Client) -> None:
            while not self._stopping.is_set():
                try:
                    got = [f.text async for f in tb.chat(model, PROMPT, max_tokens=48, timeout=60)]
                except E.TokenbusError as exc:
                    self.outcomes[exc.code] += 1
                    self.errors.append(repr(exc)[:300])
                    continue
                self.outcomes["ok" if "".join(got) == want else "wrong_text"] += 1

        self._task = asyncio.gather(*(client(tb) for tb in tbs))


def _start_up(args: list[str], env: dict[str, str], log: Any) -> subprocess.Popen[bytes]:
    """`tokenbus ARGS` started, its output to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "tokenbus.cli", *args], env=env, stdout=log, stderr=log
    )


def _reconnect_tries(tb: Client) -> int:
    """How many times ``tb``'s connection has tried its server since it last logged in."""
    return max((srv.reconnects for srv in tb.nc._server_pool), default=0)


def _logged(logs: Path, pattern: str, event: str) -> bool:
    """Whether every log file matching ``pattern`` has a line of ``event``."""
    files = sorted(logs.glob(pattern))
    return bool(files) and all(f'"event": "{event}"' in f.read_text() for f in files)


@pytest.mark.fault
async def test_the_stack_users_start_rides_out_a_paused_nats_server(
    tmp_path: Path, paused: list[int]
) -> None:
    """Issue 65's shape: `tokenbus up --workers 2 --bridge-processes 2` (the locked bus, every
    stage), 8 streaming HTTP clients and 4 `tokenbus.Client` NATS clients back to back, and
    the only nats-server paused until every bridge and worker has taken it for gone; requests
    start during the pause too. Before the fix, every stream that spanned the pause ended with
    ``replica_lost`` and the NATS clients' new requests got 503: a paused server's kernel
    still accepts connections, and a socket that connected was taken for the stall's end."""
    port, nats_port = free_port(), free_port()
    data = tmp_path / "up"
    args = ["up", "--port", str(port), "--nats-port", str(nats_port), "--data-dir", str(data)]
    args += ["--workers", "2", "--bridge-processes", "2", "--sim-decode-ms", "20"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENBUS_")}
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = _start_up(args, env, log)
    tbs: list[Client] = []
    try:
        key_file = data / "dev-key"
        await wait_for(
            lambda: key_file.exists() and key_file.read_text().strip(),
            timeout=90,
            what="no dev key written",
        )
        key = key_file.read_text().strip()
        oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)

        async def ready() -> bool:
            assert proc.poll() is None, "the stack exited"
            with contextlib.suppress(openai.APIError, httpx.HTTPError):
                ref = await oai.chat.completions.create(
                    model="tokenbus-sim", messages=PROMPT, max_tokens=48
                )
                want.append(ref.choices[0].message.content)
            return bool(want)

        want: list[str | None] = []
        await wait_for(ready, timeout=90, interval=0.2, what="the stack did not serve")
        tbs = [await Client.connect(f"nats://127.0.0.1:{nats_port}", api_key=key) for _ in range(4)]
        http = _Load(oai, "tokenbus-sim", want[0], 8, max_tokens=48)
        bus = _NatsLoad(tbs, "tokenbus-sim", want[0])
        await http.served(8, "the HTTP load did not start")
        await bus.served(4, "the NATS load did not start")
        nats_pid = child_matching(proc.pid, "nats-server")
        assert nats_pid is not None
        pause(paused, nats_pid)
        logs = data / "logs"
        await wait_for(
            lambda: (
                _logged(logs, "bridge-*.log", "nats_disconnected")
                and _logged(logs, "worker-*.log", "nats_disconnected")
            ),
            timeout=30,
            what="the bridges and workers did not take the paused server for gone",
        )
        # A paused server's kernel still accepts connections: once the NATS clients have
        # tried one (it connected, and nothing answered), requests start while it is paused.
        # They wait for it, within their deadlines.
        await wait_for(
            lambda: all(_reconnect_tries(tb) >= 1 for tb in tbs),
            timeout=30,
            what="the NATS clients did not try to reconnect",
        )
        late_http = [
            asyncio.create_task(
                oai.chat.completions.create(
                    model="tokenbus-sim", messages=PROMPT, max_tokens=48, timeout=60
                )
            )
            for _ in range(2)
        ]
        late_nats = [
            asyncio.create_task(
                tbs[0].chat_completion("tokenbus-sim", PROMPT, max_tokens=48, timeout=60)
            )
        ]
        # Paused until every client has tried again twice more (about 8 s: nats-py waits
        # its connect timeout for a server that accepted the socket): before the fix, that
        # long a pause cut every stream that spanned it.
        await wait_for(
            lambda: all(_reconnect_tries(tb) >= 3 for tb in tbs),
            timeout=60,
            what="the NATS clients did not keep trying",
        )
        os.kill(nats_pid, signal.SIGCONT)
        await http.served(8, "HTTP was not served after the pause")
        await bus.served(4, "NATS was not served after the pause")
        await http.stop()
        await bus.stop()
        late = [r.choices[0].message.content for r in await asyncio.gather(*late_http)]
        late += [c.text for c in await asyncio.gather(*late_nats)]
        print(f"\npaused under load: http {dict(http.outcomes)}, nats {dict(bus.outcomes)}")
        assert late == [want[0]] * 3
        for load in (http, bus):
            assert load.outcomes["ok"] == sum(load.outcomes.values()), (
                load.outcomes,
                load.errors[:3],
            )
    finally:
        for tb in tbs:
            with contextlib.suppress(Exception):
                await tb.close()
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        stop_process(proc, 60)
        log.close()


@pytest.mark.fault
async def test_the_watchdog_restarts_a_paused_process(
    nats_server: NatsServer, tmp_path: Path, paused: list[int]
) -> None:
    """`tokenbus up`'s supervisor kills a child whose loop stopped writing its health file
    (here: paused) and starts it again; a child that is slow to start is left alone."""
    sup = Supervisor(tmp_path / "logs", echo=False, watchdog_s=5.0)
    child = Child(
        "filter",
        [sys.executable, "-m", "tokenbus.cli", "serve", "filter"],
        {"TOKENBUS_NATS_URL": nats_server.url, "TOKENBUS_LOG_LEVEL": "warning"},
    )
    await sup.add(child)
    watch = asyncio.get_running_loop().create_task(sup.watch())
    try:
        health = sup.health_file(child)
        await wait_for(health.exists, timeout=30, what="no health file")
        assert child.proc is not None
        first = child.proc.pid
        pause(paused, first)
        await wait_for(
            lambda: child.proc is not None and child.proc.pid != first and health.exists(),
            timeout=40,
            what="the paused child not restarted",
        )
        assert child.stalls == 1 and child.restarts == 1
        assert child.alive()  # the new one runs
    finally:
        watch.cancel()
        await sup.stop(10)


@pytest.mark.fault
async def test_a_partitioned_worker_host_s_streams_move_to_another(
    hosts: netns.Hosts, tmp_path: Path, model: str
) -> None:
    """Two worker hosts (network namespaces); one's link goes down under streaming HTTP
    load, its sockets open and nothing reset: its streams continue on the other host, whole
    and right, none cut; once the link is back the host reconnects and serves again."""
    w0, w1 = hosts.add("w0"), hosts.add("w1")
    port = free_port()
    srv = spawn_nats(port, "-a", "0.0.0.0", "-p", str(port), "-js", "-sd", str(tmp_path / "js"))
    far = f"nats://{hosts.gateway}:{port}"
    try:
        with Procs(f"nats://127.0.0.1:{port}", tmp_path) as procs:
            args = SIM_PACE
            for i, host in enumerate((w0, w1)):
                procs.start(
                    f"worker-{i}",
                    *("serve", "worker", "--model", model, "--replica", f"{model}-{i}", *args),
                    env={"TOKENBUS_NATS_URL": far},
                    prefix=host.prefix(),
                )
            await wait_replicas(procs.url, model, 2)
            stack = await start_stack(procs, model, "ingress", "router", workers=0)
            async with stack.openai() as oai:
                want = await _stream_text(oai, model, [], 60)
                load = _Load(oai, model, want, 4, max_tokens=60)
                await load.served(4, "the load did not start")
                hosts.cut(w0)
                await load.served(8, "the load was not served after the cut")
                await load.stop()
                outcomes = load.outcomes
                print(
                    f"\nworker host partitioned under load: {dict(outcomes)}, longest wait "
                    f"between two chunks {max(load.gaps):.2f} s"
                )
                assert outcomes["ok"] > 8, outcomes
                assert outcomes["ok"] == sum(outcomes.values()), (outcomes, load.errors)
                hosts.heal(w0)
                # Back on the bus: the host's worker beats again and is routed to.
                await wait_replicas(procs.url, model, 2, timeout=30)
            assert procs.all_alive()
    finally:
        stop_process(srv)


@pytest.mark.bus
async def test_a_request_a_router_queues_is_not_sent_again(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """A request held in a router's queue longer than the accept timeout is not taken for
    lost: the router says it holds it (hold frames), the caller waits, and it is served
    once a slot frees, never sent again."""
    over = {"router": {"queue_timeout_s": 30.0}}
    async with stack(nats_server.url, model, workers=1, worker={"max_concurrency": 1}, **over):
        busy = client.chat(model, PROMPT, max_tokens=100_000, ignore_eos=True)
        await busy.__anext__()
        queued = client.chat(model, PROMPT, max_tokens=2)
        await queued.start()
        # Held past the accept timeout, with every hold frame on time.
        held = caller.ACCEPT_TIMEOUT_S / runtime.HOLD_NOTICE_S + 2
        await wait_for(lambda: queued.holds >= held, timeout=30, what="no hold frames")
        await busy.aclose()
        out = await asyncio.wait_for(queued.collect(), 30)
    assert out.usage.completion_tokens == 2
    assert queued.resends == 0


@pytest.mark.bus
async def test_a_stage_that_comes_back_a_moment_late_is_not_called_absent(
    private_nats: NatsServer, model: str
) -> None:
    """After a pause of the only nats-server, every service reconnects in its own time: an
    ingress back before its next stage found no responders and answered 503 "no route service
    is running" (CI run qq). The queue group of a stage that beat lately, with no responders,
    is tried again for a moment before the caller is told so: a stage subscribed after the
    first bounce gets the request. One that never beat is said absent at once."""
    async with stack(private_nats.url, model, workers=0, with_router=False) as svcs:
        ingress = svcs["ingress"]
        nc = await connect(private_nats.url, "late-stage")
        c = await Client.connect(private_nats.url)
        beat = members.Beat(nc, "late", [subjects.STAGE_ROUTE], every=0.1)
        try:
            # Never beat: absent at once (the first bounce answers).
            with pytest.raises(E.ServiceUnavailable, match="no route service is running"):
                await asyncio.wait_for(c.chat(model, PROMPT, max_tokens=2).collect(), 30)
            assert ingress.bounces == 1
            # A member beats (the stage ran, its connection is away a moment).
            beat.start()
            await wait_for(lambda: ingress.members.known(subjects.stage("route")), timeout=10)
            arrived: list[Any] = []

            async def take(msg: Any) -> None:
                arrived.append(msg)

            s = c.chat(model, PROMPT, max_tokens=2)
            await s.start()
            await wait_for(lambda: ingress.bounces > 1, timeout=10, what="no bounce")
            # The stage comes: the request is sent again, to it.
            await nc.subscribe(subjects.stage(subjects.STAGE_ROUTE), queue="late", cb=take)
            await nc.flush()
            await wait_for(lambda: arrived, timeout=10, what="the request was not sent again")
            # Sent as the first time: the caller's inbox to answer, the ingress's to bounce.
            again = arrived[0]
            assert again.reply.startswith(ingress._bounce_prefix), again.reply
            assert again.headers[H.REPLY_TO] and not again.headers[H.REPLY_TO].startswith(
                ingress._bounce_prefix
            )
            assert model.encode() in again.data
            await s.aclose()
            # A stage that stays away is still named to the caller, after the retries.
            await nc.close()
            with pytest.raises(E.ServiceUnavailable, match="no route service is running"):
                await asyncio.wait_for(c.chat(model, PROMPT, max_tokens=2).collect(), 30)
        finally:
            await beat.gone()
            await c.close()
            await nc.close()


@pytest.mark.bus
async def test_a_member_that_stopped_listening_is_passed_over_after_its_bounce(
    private_nats: NatsServer, model: str
) -> None:
    """A forwarder sends to one member's own subject while another member is stalled; that
    member has stopped listening (drained): NATS answers no responders, the request goes to
    the queue group after all, and the forwarder forgets the member, so the next request is
    not sent to it again (before: it forgot the bounce inbox's subject, which named nobody)."""
    async with stack(private_nats.url, model, workers=0, with_router=False) as svcs:
        ingress = svcs["ingress"]
        nc = await connect(private_nats.url, "members-gone")
        c = await Client.connect(private_nats.url)
        route = subjects.stage(subjects.STAGE_ROUTE)
        x = members.Beat(nc, "x", [subjects.STAGE_ROUTE], every=0.1)
        y = members.Beat(nc, "y", [subjects.STAGE_ROUTE], every=0.1)
        try:
            x.start()
            y.start()
            await wait_for(
                lambda: ingress.members.live(subjects.STAGE_ROUTE) == (["x", "y"], 2), timeout=10
            )
            assert y._task is not None
            y._task.cancel()  # stalled: no beat, no "gone"
            only_x = subjects.to_member("x", route)
            await wait_for(lambda: ingress.members.subject_for(route) == only_x, timeout=10)
            arrived: list[Any] = []

            async def take(msg: Any) -> None:
                arrived.append(msg)

            # x listens only on the queue group: its own subject has no responders.
            await nc.subscribe(route, queue="gone", cb=take)
            await nc.flush()
            s = c.chat(model, PROMPT, max_tokens=2)
            await s.start()
            await wait_for(lambda: arrived, timeout=10, what="the request sent to the group")
            assert ingress.bounces >= 1
            assert ingress.members.subject_for(route) != only_x
            await s.aclose()
        finally:
            await x.gone()
            await c.close()
            await nc.close()


@pytest.mark.bus
async def test_senders_pass_over_a_member_that_stopped_beating(nats_server: NatsServer) -> None:
    """Two members of a stage's queue group beat; one stops (a paused process): a sender
    sends to the other by its own subject, and to the queue group again once the one that
    stopped says it is gone (drained) or every member beats."""
    nc = await connect(nats_server.url, "members-test")
    try:
        view = members.Members(nc)
        await view.start()
        stage = subjects.stage(subjects.STAGE_AUTH)
        a = members.Beat(nc, "a", [subjects.STAGE_AUTH], every=0.1)
        b = members.Beat(nc, "b", [subjects.STAGE_AUTH], every=0.1)
        a.start()
        b.start()
        await wait_for(lambda: view.live(subjects.STAGE_AUTH) == (["a", "b"], 2), timeout=5)
        assert view.subject_for(stage) == stage  # every member beats: the queue group
        assert a._task is not None
        a._task.cancel()  # stalled: no beat, no "gone"
        only_b = subjects.to_member("b", stage)
        await wait_for(lambda: view.subject_for(stage) == only_b, timeout=5, what="not passed over")
        assert {view.subject_for(stage) for _ in range(50)} == {only_b}
        # Other groups and subjects are not touched.
        route = subjects.stage(subjects.STAGE_ROUTE)
        assert view.subject_for(route) == route
        # Gone (drained): no member known beats but the stalled one: the queue group.
        await b.gone()
        await wait_for(lambda: view.live(subjects.STAGE_AUTH) == ([], 1), timeout=5)
        assert view.subject_for(stage) == stage
        # A member's own subject that had no responders is forgotten at once.
        c = members.Beat(nc, "c", [subjects.STAGE_AUTH], every=0.1)
        c.start()
        only_c = subjects.to_member("c", stage)
        await wait_for(lambda: view.subject_for(stage) == only_c, timeout=5)
        assert c._task is not None
        c._task.cancel()
        await nc.flush()  # its last beat, if one was on the way, is here
        view.forget(only_c)
        assert view.live(subjects.STAGE_AUTH) == ([], 1)
        await view.stop()
    finally:
        await nc.close()


@pytest.mark.bus
async def test_a_dispatch_sent_again_is_acknowledged_not_run_twice(
    nats_server: NatsServer, model: str, client: Client
) -> None:
    """A router whose ack from a worker was lost while the bus stalled asks the same worker
    again (router/dispatch.py): the worker acknowledges the request it already runs and
    does not start it a second time."""
    async with stack(nats_server.url, model, workers=1) as svcs:
        worker = svcs["workers"][0]
        seen: list[Any] = []

        async def keep(msg: Any) -> None:
            seen.append(msg)

        spy = await client.nc.subscribe(subjects.engine_generate(model, worker.replica), cb=keep)
        s = client.chat(model, PROMPT, max_tokens=100_000, ignore_eos=True)
        first = await s.__anext__()
        await wait_for(lambda: seen, timeout=5, what="the dispatch was not seen")
        again = seen[0]
        frames_: list[dict[str, Any]] = []

        async def frame(msg: Any) -> None:
            frames_.append(codec.decode_map(msg.data))

        inbox = await client.nc.subscribe(again.headers[H.REPLY_TO], cb=frame)
        ack = await client.nc.request(again.subject, again.data, headers=again.headers, timeout=5)
        assert codec.decode_map(ack.data)["ok"] is True
        # The stream goes on; no second accept (a second run) came after the ack.
        await wait_for(lambda: len(frames_) >= 3, timeout=10, what="the stream stopped")
        assert [f for f in frames_ if f.get("t") != "c"] == []
        assert len(worker._active) == 1
        await s.aclose()
        await inbox.unsubscribe()
        await spy.unsubscribe()
    assert first.text


@pytest.mark.unit
async def test_a_task_whose_cancel_was_lost_is_cancelled_again() -> None:
    """runtime.cancel_and_wait: a loop whose cancel was lost (on Python 3.11 asyncio.wait_for,
    under nats-py's fetch, returns a result that came at the moment of the cancel) is
    cancelled again until it ends; ``cancel(); await task`` waited for it forever. One that
    never ends is left after the bound, not waited on."""
    turns, lose = 0, 2
    fetching = asyncio.Event()

    async def pull() -> None:
        nonlocal turns
        while True:
            try:
                fetching.set()
                await asyncio.Event().wait()  # a fetch that nothing answers
            except asyncio.CancelledError:
                turns += 1
                if turns <= lose:
                    continue  # the cancel lost: the loop goes on
                raise

    task = asyncio.get_running_loop().create_task(pull())
    await asyncio.wait_for(fetching.wait(), 10)
    await runtime.cancel_and_wait(task)
    assert task.cancelled() and turns == 3
    turns, lose = 0, 10**9
    fetching.clear()
    stuck = asyncio.get_running_loop().create_task(pull())
    await asyncio.wait_for(fetching.wait(), 10)
    await runtime.cancel_and_wait(stuck, within_s=0.5)
    assert not stuck.done() and turns >= 2
    lose = 0  # now it can end
    await runtime.cancel_and_wait(stuck)
    assert stuck.cancelled()


@pytest.mark.stack
async def test_sigusr1_logs_where_each_task_waits_and_the_service_goes_on(
    procs: Procs, model: str, client: Client
) -> None:
    """A service that does not finish draining, or stops answering while its loop turns:
    SIGUSR1 logs every task on its loop with the stack it waits in (``task_stack``), and the
    service goes on serving."""
    stack_ = await start_stack(procs, model, "ingress", "router", bridge=False)
    ingress = stack_.roles["ingress"][0]
    ingress.signal(signal.SIGUSR1)

    def dumped() -> list[dict[str, Any]]:
        lines = ingress.output().splitlines()
        return [json.loads(x) for x in lines if x.startswith("{") and '"task_stack"' in x]

    await wait_for(lambda: dumped() and len(dumped()) == dumped()[0]["of"], timeout=10)
    stacks = dumped()
    assert all(isinstance(d["stack"], list) for d in stacks), stacks[0]
    # The main task, from its outermost coroutine down to where it waits for a signal.
    main = next(d["stack"] for d in stacks if any("in _serve" in f for f in d["stack"]))
    assert any(
        "services/runtime.py" in f and f.endswith(" in _serve") and nxt.endswith(" in wait")
        for f, nxt in itertools.pairwise(main)
    ), main  # asyncio.wait: for SIGTERM
    out = await client.chat_completion(model, [{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.completion_tokens == 2 and ingress.alive()


@pytest.mark.stack
def test_a_process_whose_event_loop_is_stuck_ends_itself(tmp_path: Path) -> None:
    """The loop watchdog (``loop_watchdog_s``, compose sets 30 s): a process whose event
    loop stops turning (a blocking call) exits with 70, so a restart policy brings it back;
    one whose loop turns is left alone."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import asyncio, sys, time\n"
        "from services.runtime import LoopWatchdog\n"
        "async def main():\n"
        "    LoopWatchdog(0.5).start()\n"
        "    await asyncio.sleep(1.5)  # turning: nothing happens\n"
        "    print('alive', flush=True)\n"
        "    time.sleep(30)  # stuck\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        timeout=25,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == runtime.LoopWatchdog.EXIT_CODE, proc
    assert proc.stdout.strip() == b"alive"
    assert b"event_loop_stuck" in proc.stderr
