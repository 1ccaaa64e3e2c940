"""Event delivery: a subscriber that falls behind is lagged, the publisher never waits."""

from __future__ import annotations

import asyncio

from retrograd.server.events import Hub, frame


def test_a_slow_subscriber_is_lagged_and_the_others_get_everything():
    async def scenario():
        hub = Hub(size=3)
        slow, fast, merged = hub.subscribe("r1"), hub.subscribe("r1"), hub.subscribe(None)
        got = []
        for seq in range(1, 9):
            hub.publish("r1", {"seq": seq, "type": "progress"})  # never blocks
            await asyncio.sleep(0)  # the loop delivers
            got.append((await fast.next())["seq"])
            assert (await merged.next())["run"] == "r1"
        hub.publish("r2", {"seq": 1, "type": "status"})  # another run's: not for r1's streams
        await asyncio.sleep(0)
        drained = await slow.next()
        return got, drained, fast.queue.qsize(), (await merged.next())["run"]

    got, drained, left, other = asyncio.run(scenario())
    assert got == list(range(1, 9)) and left == 0 and other == "r2"
    assert drained is None  # lagged: its stream ends at once, the client replays with since


def test_frames_carry_the_sequence_as_id():
    text = frame({"seq": 7, "type": "terminal", "status": "completed"})
    assert text.startswith("id: 7\nevent: terminal\ndata: {") and text.endswith("}\n\n")
