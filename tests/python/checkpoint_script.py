"""Subprocess driver for the checkpoint fault tests (a fresh interpreter: no fork after OpenMP).

python checkpoint_script.py diskfull CKPT_DIR OUT_JSON
python checkpoint_script.py loop CKPT_DIR            saves steps 1, 2, ... until killed
"""

import json
import os
import resource
import signal
import sys

import torch

import ettkit
from ettkit.checkpoint import AsyncCheckpointer


def loop_state(step: int):
    # Every tensor is a function of the step, so a loaded step can be checked exactly.
    return {"a": torch.full((300_000,), float(step)), "b": torch.arange(1000, dtype=torch.int64) * step,
            "small": torch.tensor([step, -step], dtype=torch.int32)}


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "loop":
        with AsyncCheckpointer(path, recorder=None, keep_last=3) as ck:
            step = 0
            print("ready", flush=True)
            while True:
                step += 1
                ck.save(step, loop_state(step), extra={"step": step}).wait_staged()
    if mode == "diskfull":
        sys.path.insert(0, os.path.dirname(__file__))
        from test_checkpoint import make_state

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        ck = AsyncCheckpointer(path, recorder=None)
        ck.save(1, make_state(1)).wait()
        big = make_state(2)
        big["model"]["huge"] = torch.ones(1 << 19)  # 2 MiB > the 1 MiB file-size limit
        h = ck.save(2, big)
        try:
            h.wait()
            err = None
        except ettkit.IoError as e:
            err = str(e)
        ck.save(3, make_state(3)).wait()  # training and saving go on
        res = {"err": err, "handle_error": type(h.error).__name__, "durable": h.durable,
               "dirs": sorted(p for p in os.listdir(path) if p.startswith("step"))}
        ck.close()
        with open(sys.argv[3], "w") as f:
            json.dump(res, f)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
