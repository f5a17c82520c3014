"""Manager quorum tests rerun with a client that sends the request without waiting.

The native ``ManagerClient`` has ``_quorum_start``: the Manager then sends the quorum request
at ``start_quorum`` and adopts the answer at the first ``wait_quorum`` instead of running the
quorum on its worker thread. The fake client here adds that method to the fakes of
``_manager_kit`` and the quorum-related Manager tests run again against it (in their own
module, so they get their own store).
"""

from __future__ import annotations

from typing import Any

import pytest
from _manager_kit import (  # noqa: F401 - fixtures, found by pytest by name
    FakeNative,
    harness_fixture,
    make_quorum,
    master_store_fixture,
    store_fixture,
)
from test_manager_allreduce import (  # noqa: F401 - collected again here
    test_allreduce_avg_divides_by_participants,
    test_non_participant_sends_zeros_async,
)
from test_manager_healing import (  # noqa: F401 - collected again here
    test_heal_async_applies_in_should_commit,
    test_heal_failure_blocks_commit,
    test_heal_timeout_is_recorded_not_raised,
    test_sends_checkpoint_to_recovering_peers,
)
from test_manager_step import (  # noqa: F401 - collected again here
    test_configure_only_on_new_quorum_id,
    test_happy_path_commits_and_advances,
)
from test_manager_timeouts import (  # noqa: F401 - collected again here
    test_async_quorum_overlaps_caller,
    test_quorum_other_error_is_recorded,
    test_quorum_timeout_surfaces_as_timeout_error,
)


class FakePending:
    """Stands in for the native PendingQuorum: the request is answered when waited for."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.waited = False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> Any:
        if self.waited:
            raise RuntimeError("pending quorum was already waited for")
        self.waited = True
        return self._call()


@pytest.fixture
def native() -> FakeNative:
    """FakeNative whose client also has ``_quorum_start``."""
    fake = FakeNative()
    base = fake.ManagerClient

    class StartingClient(base):  # type: ignore[misc, valid-type]
        def _quorum_start(self, **kwargs: Any) -> FakePending:
            return FakePending(lambda: self._quorum(**kwargs))

    fake.ManagerClient = StartingClient
    return fake


def test_pending_path_is_used(harness: Any) -> None:
    """With ``_quorum_start`` the request is sent at start_quorum, answered at wait_quorum."""
    h = harness()
    m = h.manager
    m.start_quorum()
    assert len(h.native.quorum_calls) == 0  # FakePending answers only when waited for
    m.wait_quorum()
    assert len(h.native.quorum_calls) == 1
    assert m.should_commit()
    assert m.current_step() == 1


def test_loss_while_the_request_is_in_flight_does_not_fail_the_step(harness: Any) -> None:
    """A member of the previous quorum lost while the next request is in flight: the answer
    (a new quorum without it) is used and the step commits; failing it would make this rank
    skip collectives its new peers are already waiting in."""
    h = harness()
    two = {"replica_rank": 0, "replica_world_size": 2, "max_world_size": 2}
    h.native.quorums = [
        make_quorum(quorum_id=7, replica_ids=["rg0", "rg1", "dead"], **two),
        make_quorum(quorum_id=8, replica_ids=["rg0", "rg1"], **two),
    ]
    m = h.manager
    m.start_quorum()
    assert m.should_commit()
    m.start_quorum()  # the request for the next step is in flight...
    m._on_lost("dead", 7)  # ...when the lighthouse reports the loss
    assert m.errored() is None
    assert m.should_commit()
    assert [c[0] for c in h.pg.configures] == [
        "storehost:1234/torchft/7/0",
        "storehost:1234/torchft/8/0",
    ]
