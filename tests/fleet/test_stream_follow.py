"""A streaming job followed on another instance than the one running it, with real
`thaw serve` instances on PostgreSQL: its items arrive as the owner makes them, in
order, and a follower that reconnects with `Last-Event-ID` (to any instance, nginx
choosing) goes on after the last item it had: no gaps, no repeats, then the result.

The owner's generator is held midway by a file, so the test decides what exists
when each follower reads.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from tests.fleet.conftest import MakeFleet
from tests.sse import SSE, collect, read_events
from tests.support import until

LEASE_S = "600"


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_follower_on_another_instance_gets_every_item_once_in_order_and_resumes(
    make_fleet: MakeFleet, tmp_path: Path
) -> None:
    ticks, hold = tmp_path / "ticks.log", tmp_path / "hold"
    hold.touch()
    fleet = make_fleet(2, THAW_JOB_LEASE_S=LEASE_S, THAW_TEST_TICK_LOG=str(ticks))
    owner, other = fleet.instances
    with owner.client() as here, other.client() as there, fleet.client() as balanced:
        job_id = (
            here.post("/handlers/ticks/jobs", json={"n": 6, "hold": str(hold), "hold_at": 3})
            .raise_for_status()
            .json()["id"]
        )
        until(lambda: "tick 2" in lines(ticks), "the owner to make three items")

        # On the other instance: the three items that exist, as the owner wrote them.
        got: list[dict[str, str]] = []
        with there.stream("GET", f"/jobs/{job_id}", headers=SSE) as response:
            assert response.status_code == 200
            for event in read_events(response.iter_lines()):
                if "comment" in event:
                    continue
                got.append(event)
                if len(got) == 2:
                    break  # the follower goes away after item 1
        assert [(e["id"], orjson.loads(e["data"])) for e in got] == [
            ("0", {"text": "t0 "}),
            ("1", {"text": "t1 "}),
        ]

        # It comes back, through nginx, with the last id it had; the owner goes on.
        hold.unlink()
        with balanced.stream(
            "GET", f"/jobs/{job_id}", headers={**SSE, "last-event-id": "1"}
        ) as response:
            resumed = collect(response)
        assert [e["id"] for e in resumed[:-1]] == ["2", "3", "4", "5"]
        assert [orjson.loads(e["data"])["text"] for e in resumed[:-1]] == [
            "t2 ",
            "t3 ",
            "t4 ",
            "t5 ",
        ]
        assert resumed[-1]["event"] == "result"
        assert orjson.loads(resumed[-1]["data"]) == {"text": "t0 t1 t2 t3 t4 t5 ", "ticks": 6}

        # After the end, on the instance that did not run it: every item, then the result.
        with there.stream("GET", f"/jobs/{job_id}", headers=SSE) as response:
            replay = collect(response)
        assert [e.get("id") for e in replay] == ["0", "1", "2", "3", "4", "5", None]
        assert lines(ticks).count("end 6 done") == 1
