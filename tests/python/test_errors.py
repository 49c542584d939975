"""ettkit's exception classes (#17, "one error funnel"): defined once, in ettkit._C, which raises them;
ettkit.errors re-exports the same objects. Each subclasses the builtin a Python user would catch, survives
pickling (a multiprocessing worker's error), and the C++ errors arrive as them without C++ locations."""

import builtins
import pickle

import ettkit
import ettkit._C as C
import ettkit.errors as E
import pytest

EXPECTED_BASES = {
    "Error": (RuntimeError,),
    "InvalidArgumentError": (E.Error, ValueError),
    "CorruptDataError": (E.Error, ValueError),
    "CheckpointError": (E.Error,),
    "CorruptCheckpointError": (E.CorruptDataError, E.CheckpointError),
    "PeerLostError": (E.CheckpointError,),
    "CheckpointLockedError": (E.CheckpointError,),
    "TornSnapshotError": (E.CheckpointError,),
    "IoError": (E.Error, OSError),
    "TimeoutError": (E.Error, builtins.TimeoutError),
    "UnsupportedError": (E.Error,),
    "StageError": (E.Error,),
    "CancelledError": (E.Error,),
    "BatchMismatchError": (E.InvalidArgumentError,),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BASES))
def test_each_class_is_defined_once_with_its_bases_a_docstring_and_a_stable_name(name):
    cls = getattr(E, name)
    assert cls is getattr(C, name)
    # Re-exported at the top level too (`ettkit.TornSnapshotError`): a dropped re-export fails here.
    assert getattr(ettkit, name, None) is cls, f"ettkit.{name} is not ettkit.errors.{name}"
    assert cls.__bases__ == EXPECTED_BASES[name]
    assert cls.__module__ == "ettkit.errors" and cls.__qualname__ == name
    assert cls.__doc__ and len(cls.__doc__) > 20
    e = pickle.loads(pickle.dumps(cls("what went wrong")))
    assert type(e) is cls and str(e) == "what went wrong"


def test_every_public_class_is_listed():
    assert set(E.__all__) == set(EXPECTED_BASES) | {"NoRecorderWarning"}


def test_cpp_errors_arrive_as_the_classes_with_the_users_text(tmp_path):
    from ettkit.checkpoint import AsyncCheckpointer

    with pytest.raises(E.InvalidArgumentError) as info:
        AsyncCheckpointer(tmp_path / "ck", recorder=None, keep_last=-1)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == "keep_last=-1 must be >= 0 (0 keeps every step)"  # no "[src/...cpp:N]"
    (tmp_path / "ck" / "step-1").mkdir(parents=True)
    (tmp_path / "ck" / "step-1" / "manifest.json").write_text("{not json")
    with AsyncCheckpointer(tmp_path / "ck", recorder=None) as ck:
        with pytest.raises(E.CorruptCheckpointError):
            ck.load_latest({"w": __import__("torch").zeros(1)})
