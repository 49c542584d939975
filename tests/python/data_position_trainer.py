"""A trainer whose checkpoints carry its data position (test_checkpoint_data_position.py).

    data_position_trainer.py MODE RUN_DIR STEPS KILL_AT OUT WORKERS

MODE ``stateful``: torchdata's StatefulDataLoader saved as a Stateful, with a sampler seeded per epoch and the
epoch saved beside it; ``position``: a plain DataLoader whose
epoch order is seeded by the epoch, with ettkit's DataPosition. Saves every 5 steps; at step KILL_AT it waits
for its saves to be durable and dies by SIGKILL (-1: never). A run that finds a checkpoint resumes from it.
Every trained step's sample ids go to OUT/steps-<pid>.jsonl.
"""

import json
import os
import signal
import sys

import torch
from ettkit.checkpoint import AsyncCheckpointer, DataPosition
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

mode, run_dir, steps, kill_at, out, workers = sys.argv[1:7]
steps, kill_at, workers = int(steps), int(kill_at), int(workers)
torch.manual_seed(0)
dataset = TensorDataset(torch.randn(200, 3), torch.arange(200))  # 50 batches of 4 per epoch
model = torch.nn.Linear(3, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
state = {"model": model, "optim": opt}
if mode == "stateful":
    from torch.utils.data.distributed import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    # The order of an epoch must be a function of the epoch: StatefulDataLoader(shuffle=True) restores the
    # current epoch exactly but draws the next epochs' orders from a generator that is not in its state.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
    loader = StatefulDataLoader(dataset, batch_size=4, sampler=sampler, num_workers=workers)
    state["loader"] = loader
    state["epoch"] = 0  # a plain int: load_latest puts the saved value back into this dict
else:
    order = torch.Generator()
    loader = DataLoader(dataset, batch_size=4, sampler=RandomSampler(dataset, generator=order),
                        num_workers=workers)
    position = DataPosition()
    state["data"] = position

log = open(os.path.join(out, f"steps-{os.getpid()}.jsonl"), "w")
with AsyncCheckpointer(run_dir, keep_last=2) as ck:
    restored = ck.load_latest(state)
    step = restored[0] if restored else 0
    log.write(json.dumps({"restored": step}) + "\n")

    def epoch_batches():
        if mode == "stateful":
            while True:
                sampler.set_epoch(state["epoch"])
                yield from loader  # after load_state_dict, the first iter() resumes mid-epoch
                state["epoch"] += 1
        for epoch in position.epochs():
            order.manual_seed(100 + epoch)  # the epoch's order is a function of the epoch
            yield from position.iterate(loader)

    for x, ids in epoch_batches():
        step += 1
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        log.write(json.dumps({"step": step, "ids": ids.tolist()}) + "\n")
        if step % 5 == 0:
            ck.save(step, state)
        if step == kill_at:
            ck.wait()  # step KILL_AT - KILL_AT % 5 is durable; the steps after it are lost
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= steps:
            break
log.close()
