"""The Python half of the one rule for layout changes (#46): ``check_sharded`` refuses only what cannot be
right (another global size or dtype, a sharded tensor without a place), never a layout alone; per-rank sharded
state that moved between ranks with a re-plan (TorchRec's fused optimizer state exists only on the ranks that
hold a shard of its table) is allowed exactly when this rank holds no shard of its parameter; and
``reconcile_moved`` hands a Stateful the state dict of its live structure. The end-to-end loads are in
test_checkpoint_torchrec.py, test_checkpoint_mesh2d.py and test_checkpoint_sharded.py."""

import pytest

import ettkit
from ettkit.checkpoint._restore import check_sharded, held_elsewhere, reconcile_moved
from ettkit.checkpoint._tensor_kinds import ShardedSlot, StatefulSlot


def slot(shards, size=(10, 4), dtype="torch.float32"):
    return ShardedSlot(size, dtype, tuple((tuple(o), tuple(s), "rank:0/cpu") for o, s in shards))


ROWS_0_5 = [((0, 0), (5, 4))]
ROWS_5_10 = [((5, 0), (5, 4))]


def state(weight, optim_state):
    """A live skeleton: a model and an optimizer, each a Stateful."""
    return {"model": StatefulSlot("model", None, None, {}, {"emb.weight": weight}),
            "optim": StatefulSlot("optim", None, None, {}, {"state": optim_state})}


def saved_state(weight, optim_state):
    """The same as a step's saved skeleton holds it: the Statefuls' state dicts in place."""
    return {"model": {"emb.weight": weight}, "optim": {"state": optim_state}}


def refused(live, saved, world_changed=False) -> str:
    with pytest.raises(ettkit.InvalidArgumentError) as e:
        check_sharded(live, saved, world_changed=world_changed)
    return str(e.value)


def test_a_layout_alone_is_not_a_mismatch_but_a_size_or_dtype_is():
    saved = saved_state(slot(ROWS_0_5), {"emb.weight": {"m": slot(ROWS_0_5)}})
    check_sharded(state(slot(ROWS_5_10), {"emb.weight": {"m": slot(ROWS_5_10)}}), saved)
    check_sharded(state(slot([((0, 0), (10, 2)), ((0, 2), (10, 2))]), {"emb.weight": {"m": slot(ROWS_0_5)}}), saved)
    msg = refused(state(slot(ROWS_0_5, size=(12, 4)), {"emb.weight": {"m": slot(ROWS_0_5)}}), saved)
    assert "'model.emb.weight'" in msg and "[12, 4]" in msg and "[10, 4]" in msg and "'optim" not in msg, msg
    msg = refused(state(slot(ROWS_0_5), {"emb.weight": {"m": slot(ROWS_0_5, dtype="torch.float16")}}), saved)
    assert "'optim.state.emb.weight.m'" in msg and "torch.float16" in msg, msg
    # A plain tensor where the checkpoint has a sharded one (read whole from its pieces), and the other way round
    # (a replica read as shards): layouts too, whose global shape and dtype the C++ loader checks against the
    # files (test_checkpoint_layout_kinds.py). Something else where a sharded tensor was saved stays refused.
    from ettkit.checkpoint._tensor_kinds import TENSOR

    check_sharded(state(TENSOR, {"emb.weight": {"m": slot(ROWS_0_5)}}), saved)
    check_sharded(state(slot(ROWS_0_5), {"emb.weight": {"m": slot(ROWS_0_5)}}),
                  saved_state(TENSOR, {"emb.weight": {"m": slot(ROWS_0_5)}}))
    # The table became a plain tensor (data-parallel after a re-plan): the fused optimizer has no place for its
    # saved state, and the refusal says why and what to do instead of hinting at a first step().
    msg = refused(state(TENSOR, {}), saved)
    assert "'optim.state.emb.weight.m': the checkpoint holds a ShardedTensor" in msg, msg
    assert "its parameter 'model.emb.weight' is a plain tensor in the state" in msg and "first step()" not in msg, msg
    assert "'model.emb.weight': the checkpoint holds a dict" in refused(
        state(slot(ROWS_0_5), {"emb.weight": {"m": slot(ROWS_0_5)}}),
        saved_state({"a": TENSOR}, {"emb.weight": {"m": slot(ROWS_0_5)}}))


def test_per_rank_state_that_moved_is_allowed_only_where_this_rank_holds_no_shard_of_its_parameter():
    # Saved under plan A: this rank held rows 0-4 of the table and their optimizer state.
    saved = saved_state(slot(ROWS_0_5), {"emb.weight": {"m": slot(ROWS_0_5)}})
    # Plan B puts the whole table on another rank: this rank's ShardedTensor has no shard and its fused
    # optimizer keeps no state for the table. Another rank reads the saved state.
    check_sharded(state(slot([]), {}), saved)
    # But a rank that holds a shard of the table and lacks its state would silently drop it: refused, with the
    # hint about optimizer state the first step creates.
    msg = refused(state(slot(ROWS_5_10), {}), saved)
    assert "'optim.state.emb.weight.m': the checkpoint holds a ShardedTensor" in msg and "first step()" in msg, msg
    # In the saved layout nothing moved: missing state is refused even for a rank without shards.
    msg = refused(state(slot(ROWS_0_5), {}), saved)
    assert "'optim.state.emb.weight.m'" in msg, msg
    # The other way: state this rank holds since the re-plan, which its old self did not save, is read from
    # the old rank that saved it (the C++ loader refuses a key no old rank saved: in reshard_test.cpp,
    # Reshard.AnotherLayoutAtTheSameWorldSizeReshardsAndKeepsEachRanksOwnState).
    check_sharded(state(slot(ROWS_5_10), {"emb.weight": {"m": slot(ROWS_5_10)}}), saved_state(slot([]), {}))


def test_a_model_that_lost_a_table_is_refused_even_when_the_layout_moved():
    saved = {"model": {"a.weight": slot(ROWS_0_5), "b.weight": slot(ROWS_0_5)}}
    live = {"model": StatefulSlot("model", None, None, {}, {"a.weight": slot(ROWS_5_10)})}
    msg = refused(live, saved, world_changed=True)
    assert "'model.b.weight': the checkpoint holds a ShardedTensor" in msg, msg


def test_reconcile_moved_gives_a_stateful_the_structure_it_holds_now():
    saved = {"state": {"t0.weight": {"m": slot(ROWS_0_5)}, "t2.weight": {"m": slot(ROWS_0_5)}}, "lr": 0.1}
    live = {"state": {"t0.weight": {"m": slot(ROWS_5_10)}, "t3.weight": {"m": slot(ROWS_5_10)}}, "lr": 0.2}
    loaded = {"optim.state.t0.weight.m": "T0", "optim.state.t3.weight.m": "T3"}
    got = reconcile_moved(saved, live, "optim", loaded)
    # t2's state went to another rank; t3's came to this one; plain values stay the saved ones.
    assert got == {"state": {"t0.weight": {"m": saved["state"]["t0.weight"]["m"]},
                             "t3.weight": {"m": live["state"]["t3.weight"]["m"]}}, "lr": 0.1}
    assert held_elsewhere(saved["state"]["t2.weight"], "optim.state.t2.weight", loaded)
    assert not held_elsewhere({}, "x", loaded) and not held_elsewhere(0.1, "optim.lr", loaded)
    # Nothing moved: unchanged.
    same = {"state": {"t0.weight": {"m": slot(ROWS_0_5)}}}
    assert reconcile_moved(same, same, "optim", {"optim.state.t0.weight.m": "T0"}) == same


def test_a_sharded_tensor_is_checked_when_only_one_side_holds_any_and_a_state_without_any_passes():
    # check_sharded skips its walk only when NEITHER side holds a sharded tensor (#64: a plain state's load).
    from ettkit.checkpoint._tensor_kinds import TENSOR

    # The state holds a sharded tensor; the checkpoint none anywhere (a dict where the table was).
    msg = refused(state(slot(ROWS_0_5), {}), saved_state({"a": TENSOR}, {}))
    assert "'model.emb.weight': the checkpoint holds a dict" in msg, msg
    # The checkpoint holds a sharded table; the state, without any sharded tensor, has no place for it.
    live = {"model": StatefulSlot("model", None, None, {}, {"other.weight": TENSOR})}
    msg = refused(live, {"model": {"other.weight": TENSOR, "emb.weight": slot(ROWS_0_5)}})
    assert "'model.emb.weight': the checkpoint holds a ShardedTensor" in msg, msg
    # Neither side: nothing to compare, nothing refused.
    check_sharded(state(TENSOR, {"emb.weight": {"m": TENSOR}}), saved_state(TENSOR, {"emb.weight": {"m": TENSOR}}))
