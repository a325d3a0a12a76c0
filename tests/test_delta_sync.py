"""Delta weight sync (megarlhf/rollout/delta.py) over a real gloo channel whose members are
threads of this process: channel rank 0 sends, ranks 1 and 2 are engine processes. Each
engine's buckets after every sync are compared bit for bit with the sender's."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from megarlhf.rollout.bridge import Channel
from megarlhf.rollout.delta import DeltaChannel

SIZES = (1000, 300)
"""Two buckets' element counts."""


class Members:
    """A sender and two engines, each a DeltaChannel on its own thread, kept across syncs."""

    def __init__(self):
        store = dist.HashStore()
        self.channels = [None] * 3

        def join(rank):
            group = dist.ProcessGroupGloo(dist.PrefixStore("delta", store), rank, 3,
                                          datetime.timedelta(seconds=20))
            self.channels[rank] = DeltaChannel(Channel(group, rank, 3), engine=rank > 0)

        self._each(join)

    def _each(self, fn) -> list:
        results, errors = [None] * 3, [None] * 3

        def call(rank):
            try:
                results[rank] = fn(rank)
            except Exception as e:  # noqa: BLE001 - handed to the test
                errors[rank] = e

        threads = [threading.Thread(target=call, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for error in errors:
            if error is not None:
                raise error
        return results

    def sync(self, buckets: list[torch.Tensor], whole: bool = False) -> list[dict]:
        """One sync of `buckets` (the sender's); each engine's received buckets checked
        against them bitwise. Returns each engine's sync metrics."""
        def member(rank):
            channel = self.channels[rank]
            channel.start(whole)
            held = [channel.exchange(i, b.numel(), b.dtype, 0, b.clone() if rank == 0 else None)
                    for i, b in enumerate(buckets)]
            if rank:
                for mine, theirs in zip(held, buckets):
                    assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))
                return channel.stats.metrics()
            return None

        return self._each(member)[1:]


def _bf16(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_only_changed_bits_travel_and_the_engines_hold_the_senders_buckets():
    members = Members()
    first = [_bf16(n, i) for i, n in enumerate(SIZES)]
    first[0][8], first[0][9] = 0.0, float("nan")
    stats = members.sync(first)
    assert [s["sync/delta_buckets"] for s in stats] == [0.0, 0.0]  # nothing to patch yet
    assert stats[0]["sync/sent_mib"] == stats[0]["sync/full_mib"] == 2 * sum(SIZES) / 2**20
    assert stats[0]["sync/changed_fraction"] == 1.0  # nothing to compare with: all counted

    # Nine elements of bucket 0 change bits, the last 0.0 -> -0.0 (equal as floats); the
    # NaN beside it keeps its bits (unequal to itself as a float); bucket 1 keeps its.
    second = [b.clone() for b in first]
    second[0][:8] += 1
    second[0][8] = -0.0
    stats = members.sync(second)
    for s in stats:
        assert s["sync/delta_buckets"] == 2.0
        assert s["sync/changed_fraction"] == pytest.approx(9 / sum(SIZES))
        # 9 changed elements: an int32 index and a bf16 value each
        assert s["sync/sent_mib"] == pytest.approx(9 * (4 + 2) / 2**20)

    # Every element of bucket 1 changes: its delta is larger than itself, so it goes whole.
    third = [second[0].clone(), second[1] + 1]
    third[0][500] += 1
    stats = members.sync(third)
    assert stats[0]["sync/delta_buckets"] == 1.0
    # The whole bucket's count is still the changed elements' (the sender compared).
    assert stats[0]["sync/changed_fraction"] == pytest.approx((1 + SIZES[1]) / sum(SIZES))
    assert stats[0]["sync/sent_mib"] == pytest.approx((1 * 6 + 2 * SIZES[1]) / 2**20)

    # A whole sync (the controller's, every delta_full_every weight versions): every bucket
    # whole, the changed count still the sender's comparison.
    fourth = [third[0].clone(), third[1].clone()]
    fourth[0][0] += 1
    stats = members.sync(fourth, whole=True)
    assert stats[0]["sync/delta_buckets"] == 0.0
    assert stats[0]["sync/sent_mib"] == stats[0]["sync/full_mib"]
    assert stats[0]["sync/changed_fraction"] == pytest.approx(1 / sum(SIZES))

    # Half of bucket 0 changes: a bitmap (a bit per element, 125 bytes) and the 500 values
    # beat 500 int32 indices with them and the whole bucket.
    fifth = [fourth[0].clone(), fourth[1].clone()]
    fifth[0][::2] += 1
    stats = members.sync(fifth)
    assert stats[0]["sync/delta_buckets"] == 2.0
    assert stats[0]["sync/sent_mib"] == pytest.approx((125 + 500 * 2) / 2**20)


def test_an_engine_without_the_base_makes_the_bucket_whole_for_everyone():
    members = Members()
    first = [_bf16(n, i) for i, n in enumerate(SIZES)]
    members.sync(first)
    # Engine 2 restarted: a fresh channel side holding no buckets. The sender offers deltas;
    # engine 2's flag turns them into whole buckets, and both engines hold the new weights.
    members.channels[2] = DeltaChannel(members.channels[2].channel, engine=True)
    second = [b + 1 for b in first]
    second[1] = first[1].clone()
    second[1][0] += 1
    stats = members.sync(second)
    assert [s["sync/delta_buckets"] for s in stats] == [0.0, 0.0]
    assert [s["sync/sent_mib"] for s in stats] == [2 * sum(SIZES) / 2**20] * 2


def test_a_damaged_base_stops_the_sync_naming_the_bucket():
    members = Members()
    first = [_bf16(n, i) for i, n in enumerate(SIZES)]
    members.sync(first)
    # Engine 1's kept copy of the last bucket loses a bit it was never sent (its recorded
    # checksum still says it holds the base): the patched bucket's CRC-32 gives it away.
    kept = members.channels[1]._bases[1].buffer
    kept.view(torch.int16)[7] ^= 1
    second = [first[0].clone(), first[1].clone()]
    second[1][0] += 1
    with pytest.raises(RuntimeError, match=r"weight sync: bucket 1 differs from the trainer's "
                                           r"after a delta sync \(CRC-32"):
        members.sync(second)


def test_two_stages_senders_each_send_their_buckets():
    """A pipeline of two stages: channel ranks 0 and 1 send bucket 0 and 1 (each taking part
    in the other's with nothing to send), ranks 2 and 3 are engines. Two syncs, the second
    with deltas from both stages; the engines hold both senders' bits."""
    store, size = dist.HashStore(), 4
    buckets = [[_bf16(n, i) for i, n in enumerate(SIZES)]]
    buckets.append([b.clone() for b in buckets[0]])
    buckets[1][0][:3] += 1
    buckets[1][1][5] += 1
    held, metrics, errors = {}, {}, []

    def member(rank):
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore("stages", store), rank, size,
                                          datetime.timedelta(seconds=20))
            channel = DeltaChannel(Channel(group, rank, size), engine=rank >= 2)
            for sync in buckets:
                channel.start(False)
                held[rank] = [channel.exchange(i, b.numel(), b.dtype, i,
                                               b.clone() if rank == i else None)
                              for i, b in enumerate(sync)]
                held[rank] = [None if t is None else t.clone() for t in held[rank]]
            metrics[rank] = channel.stats.metrics()
        except Exception as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for engine in (2, 3):
        for mine, theirs in zip(held[engine], buckets[1]):
            assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))
        assert metrics[engine]["sync/delta_buckets"] == 2.0
        assert metrics[engine]["sync/sent_mib"] == pytest.approx(4 * (4 + 2) / 2**20)
    assert held[0] == [None, None] and held[1] == [None, None]
