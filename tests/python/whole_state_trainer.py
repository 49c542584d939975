"""A trainer written from the README's usage only (Recorder, AsyncCheckpointer, attach, load_latest,
save), run as a subprocess by test_checkpoint_whole_state.py.

python whole_state_trainer.py STYLE RUN_DIR STEPS KILL_AT OUT_DIR

STYLE: "readme" captures ``{"model": model.state_dict(), "optim": optimizer.state_dict()}`` before the first
step (the pattern the README showed) and starts as the README's start-up section does: ``overlapped_start``
on a ``BatchSpec.from_batch(..., dynamic_dims={"*": 0})`` with Inductor, the loader positioned with
``latest_step``; "dcp" passes ``{"model": model, "optim": optimizer}`` and trains eagerly. At step KILL_AT
(-1: never) it waits until the save is durable, writes what it saved to OUT_DIR/expected.pt and kills itself
with SIGKILL. A process that resumed writes what it restored to OUT_DIR/resumed.pt; every run that reaches
STEPS writes OUT_DIR/final.pt.
"""

import copy
import itertools
import os
import signal
import sys

import torch

from ettkit import ett, startup
from ettkit.checkpoint import AsyncCheckpointer, latest_step


def snapshot(model, optimizer):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(optimizer.state_dict())}


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


class Batches(torch.utils.data.Dataset):
    """batch(step) for the steps still to train: a resumed job's loader starts after the restored step."""

    def __init__(self, first: int, steps: int):
        self.first, self.n = first, max(0, steps - first)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return batch(self.first + i)


def forward(model, b):
    return model(b[0])


def loss_fn(out, b):
    return torch.nn.functional.mse_loss(out, b[1])


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
            latest = latest_step(os.path.join(run_dir, "ckpt"))
            first_step = latest + 1 if latest is not None else 0
            train = model
            if style == "readme":
                loader = torch.utils.data.DataLoader(Batches(first_step, steps), batch_size=None, num_workers=1)
                # A list: the loader's default_convert turns each (x, y) tuple into one (BatchSpec says so).
                spec = startup.BatchSpec.from_batch(list(batch(0)), dynamic_dims={"*": 0})
                train, first, _, rest = startup.overlapped_start(model, loader, spec, loss_fn, forward=forward)
                batches = itertools.chain([first], rest)
            else:
                batches = (batch(step) for step in range(first_step, steps))
            restored = ck.load_latest(state)
            assert (restored[0] if restored else None) == latest
            if restored:
                resumed = {"step": restored[0], **snapshot(model, optimizer)}
                torch.save(resumed, os.path.join(out, "resumed.pt"))
            for step, (x, y) in zip(range(first_step, steps), batches):
                loss = torch.nn.functional.mse_loss(train(x), y)
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
