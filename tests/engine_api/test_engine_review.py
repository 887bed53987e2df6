"""Findings of an engine-integration review: what an engine author gets wrong without an error."""

from __future__ import annotations

import math

import pytest

from kvbridge import Backoff, ConfigError, Retry, Timeout


@pytest.mark.parametrize("kw", [{"transfer": -1}, {"connect": -1}, {"connect": 0}, {"transfer": math.nan},
                                {"transfer": math.inf}, {"lease": 0}, {"transfer": "30"}, {"connect": True}])
def test_timeout_refuses_durations_that_are_not_positive_seconds(kw: dict) -> None:
    # Timeout(connect=-1) reached the socket as a raw ValueError, Timeout(transfer=nan) as one from
    # int(nan), Timeout(transfer=-1) was taken (fetches ran with no bound), connect=0 failed every
    # connect with "Operation now in progress": all refused where the policy is built
    with pytest.raises(ConfigError, match=f"Timeout.{next(iter(kw))}"):
        Timeout(**kw)


def test_retry_and_backoff_refuse_values_that_cannot_mean_anything() -> None:
    with pytest.raises(ConfigError, match="attempts"):
        Retry(attempts=0)             # ran the call once anyway
    with pytest.raises(ConfigError, match="attempts"):
        Retry(attempts=-5)
    with pytest.raises(ConfigError, match="deadline"):
        Retry(deadline=-1)
    with pytest.raises(ConfigError, match="Backoff.base"):
        Backoff(base=-1)              # Retry.call raised a raw ValueError from time.sleep on the first retry
    with pytest.raises(ConfigError, match="Backoff.cap"):
        Backoff(cap=-1)               # delay() returned -1
    with pytest.raises(ConfigError, match="retry_on"):
        Retry(retry_on=ValueError)    # type: ignore[arg-type]   # not a tuple: isinstance() failed late


def test_policies_that_make_sense_are_kept() -> None:
    assert Backoff(base=0.0, cap=0.0).delay(5) == 0.0          # "retry at once" stays allowed
    assert Retry(attempts=1, deadline=None).attempts == 1
    assert Timeout(connect=0.5, transfer=2, lease=1).transfer == 2


def test_layout_tp_rank_must_be_an_int() -> None:
    from kvbridge import KVLayout
    # tp_rank=1.5 was accepted (every other field is checked to be an int) and went into compat_hash
    with pytest.raises(ConfigError, match="tp_rank"):
        KVLayout(2, 2, 8, 12, tp_rank=1.5, tp_size=2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tp_rank"):
        KVLayout(2, 2, 8, 12, tp_rank=-1, tp_size=2)
    assert KVLayout(2, 2, 8, 12, tp_rank=1, tp_size=2).tp_rank == 1


@pytest.mark.parametrize("request_id", [123, None, b"req"])
def test_publish_with_a_request_id_that_is_not_a_str_is_a_config_error_and_pins_nothing(request_id: object) -> None:
    """SGLang's bootstrap room is an int: publish(123, ...) raised a raw AttributeError ('int' object
    has no attribute 'encode') from inside the handle encoder -- without leases, after the engine's
    blocks were pinned, which then stayed pinned for good."""
    from kvbridge import KVLayout, KVPool, KVSender
    layout = KVLayout.vllm_flash(2, 2, 8, block_size=12, dtype="float16")
    pool = KVPool.allocate(layout, 4, allocator="engine")
    freed: list[str] = []
    with KVSender(pool, "tcp://127.0.0.1:0", leases=False, on_free=lambda h, why: freed.append(why)) as snd:
        with pytest.raises(ConfigError, match="must be str"):
            snd.publish(request_id, [1, 2], 20)  # type: ignore[arg-type]
        assert [pool.refcount(b) for b in range(4)] == [0, 0, 0, 0] and snd.num_live == 0
        assert snd.publish("ok", [1, 2], 20).request_id == "ok"
    assert freed == ["closed"]


def test_a_handle_from_before_its_sender_restarted_says_so() -> None:
    """Without a shared secret a restarted sender cannot tell its earlier handles from forgeries: the
    refusal stays BadHandle, but its text said only 'pass the handle exactly as the sender produced
    it' -- which the engine did. It names the restart and the way to get REPREFILL instead."""
    from kvbridge import BadHandle, KVLayout, KVPool, KVReceiver, KVSender
    layout = KVLayout.vllm_flash(2, 2, 8, block_size=12, dtype="float16")
    src, dst = KVPool.allocate(layout, 4, allocator="engine"), KVPool.allocate(layout, 4, allocator="engine")
    first = KVSender(src, "tcp://127.0.0.1:0", leases=False)
    h = first.publish("r", [1, 2], 20)
    first.close()
    with KVSender(src, first.url, leases=False), KVReceiver(dst, leases=False) as rcv:
        res = rcv.fetch(h, [0, 3])
    assert isinstance(res.error, BadHandle) and "restarted" in str(res.error) and "secret" in str(res.error)
