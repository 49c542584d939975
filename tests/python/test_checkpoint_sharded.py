"""ShardedTensor state in the native AsyncCheckpointer (each rank its local shards, loaded in place, another
layout refused naming the key) and ShardedTensor/DTensor state staged by DcpStager for DCP. Two gloo ranks;
tests/python/sharded_state_script.py is each rank. TorchRec's own sharded model: test_checkpoint_torchrec.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_and_dtensor_state_across_two_gloo_ranks(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "sharded_state_script.py"), str(r), "2", init,
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, (r, err[-4000:])
        assert f"ok {r}" in out
    # Each rank's file holds its own shards, named by their offsets in the whole tensor.
    from safetensors import safe_open

    names = {}
    for r in range(2):
        with safe_open(str(tmp_path / "native" / "step-1" / f"rank-{r}.safetensors"), "pt") as f:
            names[r] = sorted(f.keys())
    assert names[0] == ["dense", "emb@0,0", "nested.col@0,4"]
    assert names[1] == ["dense", "emb@6,0", "nested.col@0,0", "nested.col@0,8"]
