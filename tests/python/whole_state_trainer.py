"""A trainer written from the README's usage only (Recorder, AsyncCheckpointer, attach, load_latest,
save), run as a subprocess by test_checkpoint_whole_state.py.

python whole_state_trainer.py STYLE RUN_DIR STEPS KILL_AT OUT_DIR

STYLE: "readme" captures ``{"model": model.state_dict(), "optim": optimizer.state_dict()}`` before the first
step (the pattern the README showed); "dcp" passes ``{"model": model, "optim": optimizer}``. At step KILL_AT
(-1: never) it waits until the save is durable, writes what it saved to OUT_DIR/expected.pt and kills itself
with SIGKILL. A process that resumed writes what it restored to OUT_DIR/resumed.pt; every run that reaches
STEPS writes OUT_DIR/final.pt.
"""

import copy
import os
import signal
import sys

import torch

from ettkit import ett
from ettkit.checkpoint import AsyncCheckpointer


def snapshot(model, optimizer):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(optimizer.state_dict())}


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def main() -> int:
    style, run_dir, out = sys.argv[1], sys.argv[2], sys.argv[5]
    steps, kill_at = int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with ett.Recorder(run_dir) as rec:
        with AsyncCheckpointer(os.path.join(run_dir, "ckpt"), keep_last=3, every=5) as ck:
            ck.attach(model=model, optimizer=optimizer)
            if style == "readme":
                state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            else:
                state = {"model": model, "optim": optimizer}
            restored = ck.load_latest(state)
            if restored:
                resumed = {"step": restored[0], **snapshot(model, optimizer)}
                torch.save(resumed, os.path.join(out, "resumed.pt"))
            for step in range(restored[0] + 1 if restored else 0, steps):
                x, y = batch(step)
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if ck.should_save(step):
                    h = ck.save(step, state)
                    if step == kill_at:
                        h.wait()  # durable
                        expected = {"step": step, **snapshot(model, optimizer)}
                        torch.save(expected, os.path.join(out, "expected.pt"))
                        os.kill(os.getpid(), signal.SIGKILL)
                rec.step(step)
    torch.save(snapshot(model, optimizer), os.path.join(out, "final.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
