"""Random operation sequences against a tiny pure-Python model of the lease state machine.

TTLs are long here (no time passes in the model); lapses and expiry have their own tests.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, multiple, rule,
                                 run_state_machine_as_test)

from kvbridge.errors import LeaseConflict, LeaseExpired, LeaseNotFound, StaleFence
from kvbridge.lease import EmbeddedRedis, Fence, LeaseState, RedisLeaseStore

pytestmark = pytest.mark.timeout(120)

IDS = st.sampled_from(["l0", "l1", "l2"])
WHO = st.sampled_from(["A", "B"])
P, C, R, A, V = "P", "C", "R", "A", "V"
STATE = {P: LeaseState.PUBLISHED, C: LeaseState.CLAIMED, R: LeaseState.RELEASED,
         A: LeaseState.ABORTED}


@dataclass
class M:
    st: str
    claimer: str
    counter: int


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (LeaseConflict, LeaseExpired, LeaseNotFound, StaleFence) as exc:
        return type(exc)


def test_random_sequences_match_model(server: EmbeddedRedis) -> None:
    class Machine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store = RedisLeaseStore(server.url, namespace="m" + uuid.uuid4().hex[:12])
            self.model: dict[str, M] = {}
            self.counter = 0
            self.epoch = 0
            self.fences: dict[tuple[str, str], int] = {}  # last fence counter each claimer got

        @initialize()
        def learn_epoch(self) -> None:
            f = self.store.publish("warmup", "O", ttl_s=600).fence
            self.epoch, self.counter = f.epoch, f.counter

        def teardown(self) -> None:
            self.store.close()

        def fence(self, lid: str, who: str, old: bool) -> Fence:
            c = self.fences.get((lid, who), 0)
            return Fence(self.epoch, max(0, c - 1) if old else c)

        published = Bundle("published")
        held = Bundle("held")

        @rule(target=published, lid=IDS)
        def publish(self, lid: str) -> str:
            got = outcome(lambda: self.store.publish(lid, "O", ttl_s=600))
            if lid in self.model:
                assert got is LeaseConflict
                return lid
            self.counter += 1
            self.model[lid] = M(P, "", self.counter)
            assert got.fence == Fence(self.epoch, self.counter)
            return lid

        @rule(target=held, lid=st.one_of(published, IDS), who=WHO)
        def claim(self, lid: str, who: str) -> Any:
            got = outcome(lambda: self.store.claim(lid, who, claim_ttl_s=600))
            m = self.model.get(lid)
            if m is None:
                assert got is LeaseNotFound
            elif m.st in (V, R, A):
                assert got is LeaseExpired
            elif m.st == C and m.claimer != who:
                assert got is LeaseConflict
            else:
                if m.st == P:
                    self.counter += 1
                    m.st, m.claimer, m.counter = C, who, self.counter
                assert got.fence == Fence(self.epoch, m.counter) and got.claimer == who
                self.fences[(lid, who)] = m.counter
                return (lid, who)
            return multiple()

        def expect_holder(self, m: Optional[M], who: str, f: Fence) -> Any:
            if m is None or m.st == V:
                return LeaseExpired
            if m.claimer != who:
                return LeaseConflict
            if m.counter != f.counter:
                return StaleFence
            return None

        @rule(pair=st.one_of(held, st.tuples(IDS, WHO)), old=st.booleans(),
              kind=st.sampled_from(["release", "abort"]))
        def finish(self, pair: tuple[str, str], old: bool, kind: str) -> None:
            lid, who = pair
            f = self.fence(lid, who, old)
            got = outcome(lambda: getattr(self.store, kind)(lid, who, f))
            m = self.model.get(lid)
            want = self.expect_holder(m, who, f)
            if want is None and m is not None and kind == "release" and m.st == A:
                want = LeaseExpired    # a release validates: never after the holder's own abort
            assert got is want
            if want is None and m is not None and m.st == C:
                m.st = R if kind == "release" else A

        @rule(pair=st.one_of(held, st.tuples(IDS, WHO)), old=st.booleans())
        def validate(self, pair: tuple[str, str], old: bool) -> None:
            lid, who = pair
            f = self.fence(lid, who, old)
            got = outcome(lambda: self.store.validate(lid, who, f))
            m = self.model.get(lid)
            want = self.expect_holder(m, who, f)
            if want is None and m is not None and m.st in (R, A):
                want = LeaseExpired
            assert got is want

        @rule(lid=st.one_of(published, IDS))
        def revoke(self, lid: str) -> None:
            got = self.store.revoke(lid, "O")
            m = self.model.get(lid)
            assert got is (STATE[m.st] if m is not None and m.st != V else None)
            if m is not None and m.st in (P, C):
                m.st = V

        @rule(lid=IDS)
        def renew_owner(self, lid: str) -> None:
            got = outcome(lambda: self.store.renew(lid, "O", ttl_s=600))
            m = self.model.get(lid)
            if m is None:
                assert got is LeaseNotFound
            elif m.st == V:
                assert got is LeaseExpired
            else:
                assert got.state is STATE[m.st]

        @rule(lid=IDS)
        def get(self, lid: str) -> None:
            got = self.store.get(lid)
            m = self.model.get(lid)
            if m is None or m.st == V:
                assert got is None
            else:
                assert got is not None and got.state is STATE[m.st]
                assert got.fence == Fence(self.epoch, m.counter)
                assert got.claimer == (m.claimer or None if m.st != P else None)

        @rule()
        def sweep(self) -> None:
            ids = ["l0", "l1", "l2"]
            want = {i: (STATE[self.model[i].st] if i in self.model and self.model[i].st != V
                        else None) for i in ids}
            assert self.store.sweep("O", ids) == want

    run_state_machine_as_test(Machine, settings=settings(
        max_examples=300, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
