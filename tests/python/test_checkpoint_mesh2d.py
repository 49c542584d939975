"""DTensors on 2-D meshes (#46): HSDP (Replicate(), Shard(0)), FSDP + TP-style (Shard(0), Shard(1)) and
their kin, saved by 4 gloo ranks on a 2 x 2 mesh, load in place at that layout and reshard to other world
sizes and mesh shapes, 2-D and 1-D, and from 1-D to 2-D: every local tensor holds exactly its piece of the
saved global tensor, also in another layout at the saved world size (4 x 1, 1 x 4, 1-D at 4 ranks), where
each rank keeps its own per-rank state. Another global shape is refused naming the key. dcp.load through
EttkitStorageReader reads the same layouts."""

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "mesh2d_worker.py")
NAMES = ("hsdp", "fsdp_tp", "col_rep", "nested", "rep")


def run(tmp_path, name, world, ckpt, mode, mesh, per_rank=False):
    out = tmp_path / f"out-{name}"
    out.mkdir(exist_ok=True)
    init = f"file://{tmp_path / ('rendezvous-' + name)}"
    env = {**os.environ, "ETTKIT_LOG_LEVEL": "error", "MESH2D_PER_RANK": "1" if per_rank else "0"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), init, str(ckpt), mode, mesh, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, [e[-3000:] for _, e in results]
    return [json.loads((out / f"load-{r}.json").read_text()) for r in range(world)] if mode != "save" else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 5 saved on a 2 x 2 mesh (4 ranks; also with per-rank state) and on a 1-D mesh of 2 ranks."""
    tmp = tmp_path_factory.mktemp("mesh2d")
    run(tmp, "save2x2", 4, tmp / "ckpt-2x2", "save", "2x2")
    run(tmp, "save2x2r", 4, tmp / "ckpt-2x2-per-rank", "save", "2x2", per_rank=True)
    run(tmp, "save2", 2, tmp / "ckpt-2", "save", "2")
    return {"2x2": tmp / "ckpt-2x2", "2x2-per-rank": tmp / "ckpt-2x2-per-rank", "2": tmp / "ckpt-2"}


@pytest.mark.parametrize("saved_on,world,mesh", [("2x2", 4, "2x2"), ("2x2", 2, "2x1"), ("2x2", 2, "2"),
                                                 ("2x2", 3, "3"), ("2x2", 1, "1"), ("2", 4, "2x2")],
                         ids=lambda v: str(v))
def test_2d_mesh_dtensors_load_in_place_and_reshard_to_other_meshes(tmp_path, saved, saved_on, world, mesh):
    results = run(tmp_path, "load", world, saved[saved_on], "load", mesh)
    saved_world = 4 if saved_on == "2x2" else 2
    for r, got in enumerate(results):
        assert got["step"] == 5
        assert got["ok"] == {n: True for n in NAMES}, (r, got)
        assert got["resharded_from"] == (None if world == saved_world else saved_world), (r, got)
        if "x" in mesh:
            assert got["placements"]["hsdp"] == ["Replicate()", "Shard(dim=0)"]
        # Another global shape is refused before anything is copied, naming the key.
        assert "'dt.hsdp'" in got["errors"]["shape"] and "[10, 6]" in got["errors"]["shape"], got["errors"]


@pytest.mark.parametrize("mesh", ["2x2", "4x1", "1x4", "4"])
def test_another_layout_at_the_saved_world_size_reshards_and_each_rank_keeps_its_own_state(tmp_path, saved, mesh):
    """The 2 x 2 step at 4 ranks in another mesh shape or 1-D: each rank's shards are not in its own file,
    so it reads them from every rank's (resharded_from is the saved world size), while its per-rank state (a
    plain tensor and a non-tensor leaf that differ between ranks) is its own, not rank 0's. In place (2 x 2)
    each rank reads its own file only."""
    results = run(tmp_path, "layout", 4, saved["2x2-per-rank"], "load", mesh, per_rank=True)
    for r, got in enumerate(results):
        assert got["step"] == 5 and got["ok"] == {n: True for n in NAMES}, (r, got)
        assert got["resharded_from"] == (None if mesh == "2x2" else 4), (r, got)
        assert got["mine"] == {"t": [float(r)] * 3, "who": r}, (r, got)
        assert "'dt.hsdp'" in got["errors"]["shape"] and "[10, 6]" in got["errors"]["shape"], got["errors"]


@pytest.mark.parametrize("world,mesh", [(4, "4x1"), (3, "3")], ids=lambda v: str(v))
def test_dcp_load_through_the_storage_reader_reads_2d_mesh_dtensors_into_another_layout(tmp_path, saved, world,
                                                                                      mesh):
    """dcp.load with EttkitStorageReader: the 2 x 2 step into a 4 x 1 mesh (the same world size, another
    layout) and into a 1-D mesh of 3 ranks."""
    for r, got in enumerate(run(tmp_path, "dcp", world, saved["2x2"], "dcp", mesh)):
        assert got["ok"] == {n: True for n in NAMES}, (r, got)


def test_dcp_stager_stages_2d_mesh_dtensors_that_dcp_loads_into_other_meshes(tmp_path):
    """DcpStager under dcp.async_save on a 2 x 2 mesh: the staged copies are what DCP writes (the local tensors
    are changed right after async_save returns), and dcp.load reads them into a 4 x 1 and a 1-D mesh."""
    for r, got in enumerate(run(tmp_path, "dcpstage", 4, tmp_path / "dcp-ckpt", "dcpstage", "2x2")):
        assert got["ok"] == {m: {n: True for n in NAMES} for m in ("4x1", "4")}, (r, got)


def test_a_strided_or_partial_dtensor_is_refused_naming_the_key_and_the_placement(tmp_path):
    import ettkit
    import torch
    import torch.distributed as dist
    from ettkit.checkpoint._flatten import flatten_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1))
        for placement, named in ((_StridedShard(0, split_factor=2), "_StridedShard"), (Partial(), "Partial")):
            dt = DTensor.from_local(torch.zeros(4, 2), mesh, (Replicate(), placement), run_check=False)
            with pytest.raises(ettkit.InvalidArgumentError) as e:
                flatten_state({"w": dt})
            assert "'w'" in str(e.value) and named in str(e.value) and "DcpStager" in str(e.value)
    finally:
        dist.destroy_process_group()
