"""The boundary alone between two real ranks (subprocesses over loopback, the ring backend).

Messages arrive whole and in posting order whichever way each one leaves: a small payload in its
frame, a hidden state sent on the caller's turn (header, then transfer) or through the sender
task (a payload not computed yet, a strided view copied first), messages posted back to back
(their frames then share a read, and the receiver posts the first hidden state's recv before it
routes the frames in front of it) or one at a time.
"""

from __future__ import annotations

import json
import pathlib
import sys

from asyncside.distributed.launcher import LocalLaunch

#: a launch must end well before this (seconds); a hang fails the test instead of stalling CI
DEADLINE = 120.0
STEPS = 40

RANK_SCRIPT = '''
import json, sys

import anyio
import mlx.core as mx

from asyncside.bridge import completed
from asyncside.distributed.boundary import END, HIDDEN, PRED, TOKEN, Boundary, Message
from asyncside.distributed.control import ControlPlane
from asyncside.distributed.group import join

STEPS = int(sys.argv[2])
group = join("boundary-order-test", timeout=30.0)


def hidden(step):
    """Step ``step``'s hidden state: shapes vary; some strided, some not computed when posted."""
    h = mx.full((1, 1, 8 + 2 * (step % 3)), float(step), dtype=mx.float32)
    if step % 5 == 0:
        h = h[..., ::2]  # strided: the sender copies it first
    if step % 7 == 0:
        return h * 2  # unevaluated: the sender waits for it
    mx.eval(h)
    return h


async def main():
    got = []
    done = anyio.Event()

    async def deliver(msg):
        payload = None if msg.payload is None else msg.payload.tolist()
        got.append([msg.kind, msg.req, msg.step, msg.layer, payload])
        if msg.kind in (END, TOKEN):
            done.set()

    control = ControlPlane(group, peer_timeout_s=10.0)
    boundary = Boundary(group, control, deliver)
    async with anyio.create_task_group() as tg:
        await tg.start(control.run)
        tg.start_soon(boundary.run_sender)
        if group.rank == 0:
            for step in range(STEPS):
                for j in range(step % 3):
                    boundary.post(Message(PRED, step, mx.array([step, j], dtype=mx.int32), layer=j))
                boundary.post(Message(HIDDEN, step, hidden(step), step=step))
                if step % 4 == 3:
                    await boundary.flush()  # the next four steps go out back to back
            boundary.post(Message(END, STEPS))
            await boundary.flush()
        await done.wait()
        if group.rank == 1:
            boundary.post(Message(TOKEN, len(got), mx.array([len(got)], dtype=mx.uint32)))
        await boundary.flush()
        await completed(mx.distributed.all_sum(mx.array(1.0), group=group.group, stream=boundary.send_stream))
        await control.goodbye()
        tg.cancel_scope.cancel()
    with open(f"{sys.argv[1]}/rank{group.rank}.json", "w") as fh:
        json.dump({"got": got, "counters": boundary.counters}, fh)


anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
'''


def _expected() -> list[list[object]]:
    out: list[list[object]] = []
    for step in range(STEPS):
        for j in range(step % 3):
            out.append([2, step, 0, j, [step, j]])  # PRED
        width = 8 + 2 * (step % 3)
        if step % 5 == 0:
            width = (width + 1) // 2
        value = float(step) * (2 if step % 7 == 0 else 1)
        out.append([1, step, step, -1, [[[value] * width]]])  # HIDDEN
    out.append([4, STEPS, 0, -1, None])  # END
    return out


def test_messages_arrive_in_order_whichever_way_they_leave(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    argv = [sys.executable, str(script), str(tmp_path), str(STEPS)]
    with LocalLaunch([argv, argv]) as launch:
        res = launch.wait(DEADLINE)
    assert res.ok, "\n".join(f"--- rank {r.rank}: status {r.returncode}\n{r.stderr[-3000:]}" for r in res.ranks)
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    expected = _expected()
    assert rank1["got"] == expected
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["got"] == [[3, len(expected), 0, -1, [len(expected)]]]  # the TOKEN back
    sent = rank0["counters"]
    # Both ways of leaving were taken: on the caller's turn and through the sender task.
    assert 0 < sent["sent_at_once"] < sent["sent"] == len(expected)
