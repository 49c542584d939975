"""Rules that Python takes from C++ instead of keeping a copy (issue #64, "one owner per rule"): a manifest's
file entry (export's StepTensors decodes it with the C++ loader's decoder, naming the field its own way), the
moved verdict of the load check (_restore.py asks C++'s first_moved_shard), and the interval config records
(written by the C++ ledger adaptor through CheckpointSchedule.record_intervals)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ettkit import _C
from ettkit.errors import CorruptDataError
from ettkit.integrations.step_reader import FileChecksums

_moved = _C.checkpoint.first_moved_shard


def _entry(**edit: object) -> dict:
    data = b"x" * 100
    entry = {"size": len(data), "xxh3": _C.xxh3_hex(data), "chunk_bytes": 1 << 20, "chunks": [_C.xxh3_hex(data)]}
    entry.update(edit)
    return {k: v for k, v in entry.items() if v is not None}


def test_a_file_entry_is_decoded_by_the_cpp_decoder_and_named_the_python_way(tmp_path: Path):
    m = str(tmp_path / "manifest.json")
    sums = FileChecksums.decode(m, "rank-0.safetensors", _entry())
    assert (sums.size, sums.chunk_bytes, len(sums.chunks)) == (100, 1 << 20, 1)
    # The C++ decoder's checks and words; the field as Python's readers name it.
    cases = {
        "chunks": (_entry(chunks=["zz"]), "field 'files['rank-0.safetensors'].chunks' is \"zz\"; expected 16 "
                                          "lowercase hex digits per chunk"),
        "count": (_entry(chunks=[]), "expected an array of 1 checksums"),
        "chunk_bytes": (_entry(chunk_bytes=4096), "'files['rank-0.safetensors'].chunk_bytes' is 4096; expected an "
                                                  "integer >= 1048576"),
        "xxh3": (_entry(xxh3=None), "lacks the field 'files['rank-0.safetensors'].xxh3'"),
        "object": ([1], "field 'files['rank-0.safetensors']' is [1]; expected an object"),
    }
    for what, (entry, want) in cases.items():
        with pytest.raises(CorruptDataError) as e:
            FileChecksums.decode(m, "rank-0.safetensors", entry)
        assert f"manifest '{m}'" in str(e.value) and want in str(e.value), (what, str(e.value))
    # What C++ allows (a manifest older than chunk checksums) export still needs: every byte is verified.
    with pytest.raises(CorruptDataError, match=r"files\['rank-0.safetensors'\]' has no chunk checksums"):
        FileChecksums.decode(m, "rank-0.safetensors", _entry(chunk_bytes=None, chunks=None))


def test_the_cpp_decoder_is_the_one_the_loader_runs_with_its_own_field_names():
    text = json.dumps(_entry(chunks=["zz"]))
    with pytest.raises(CorruptDataError, match=r"field 'files\.rank-0\.safetensors\.chunks'"):
        _C.checkpoint.decode_manifest_file_entry(text, "m.json", "files.rank-0.safetensors")
    with pytest.raises(CorruptDataError, match="field 'files.x' is null"):
        _C.checkpoint.decode_manifest_file_entry("{not json", "m.json", "files.x")


def test_the_moved_verdict_is_cpps_over_what_the_skeletons_record():
    box = ((0, 0), (4, 8), "rank:0/cpu")
    assert _moved({"t": (box,)}, {"t": (box,)}) == ""
    assert _moved({"t": (box, ((4, 0), (4, 8), None))}, {"t": (((4, 0), (4, 8), None), box)}) == ""  # any order
    assert _moved({"t": (box,)}, {"t": (((0, 0), (4, 8), "rank:1/cpu"),)}) == "t@0,0"  # another placement
    assert _moved({"t": (box,)}, {"t": (((0, 0), (4, 8), None),)}) == "t@0,0"  # a placement against none
    assert _moved({"t": (box,)}, {"t": (((0, 0), (2, 8), "rank:0/cpu"),)}) == "t@0,0"  # another size
    assert _moved({}, {"t": ()}) == "t"  # a key this rank holds no shard of, which the step lacks
    assert _moved({"t": (box,)}, {}) == "t@0,0" and _moved({"t": (box,)}, {}, partial=True) == ""
    assert _moved({"t": (box,)}, {}, wanted_whole={"t"}) == "t"  # saved in pieces, wanted whole


def test_the_interval_records_are_written_by_the_schedule(tmp_path: Path):
    from ettkit import ett

    every = _C.checkpoint.Every
    with ett.Recorder(tmp_path / "run", rank=0, world_size=1) as rec:
        schedule = _C.checkpoint.CheckpointSchedule(every.steps(5), every.parse("2min"), 3600.0, 0.0, 0.0)
        _C.checkpoint.record_intervals(schedule, rec)
        auto = _C.checkpoint.CheckpointSchedule(every.parse("auto"), every.never(), 3600.0, 0.0, 0.0)
        _C.checkpoint.record_intervals(auto, rec)  # "auto" and "never": nothing
        path = rec.ledger_path
    config = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [(r["key"], r["value"]) for r in config if r["t"] == "config"] == [
        ("checkpoint_interval_steps", 5.0), ("checkpoint_memory_interval_s", 120.0)]
