"""The Lightning run of test_integration_lightning.py: a tiny regression module on CPU, checkpointed through
``EttkitCheckpointIO`` at every epoch end, phases recorded by ``EttCallback``.

python integration_lightning_worker.py RUN_DIR [KILL_STEP]

Appends ``{"step": global_step, "loss": ...}`` per optimizer step to RUN_DIR/losses.jsonl. Resumes from the
newest committed ettkit step when there is one. With KILL_STEP: once that optimizer step is done, waits until
every save so far is durable, then kills itself with SIGKILL (a deterministic crash mid-epoch).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ettkit import ett
from ettkit.integrations.lightning import EttCallback, EttkitCheckpointIO

EPOCHS, BATCH, SAMPLES = 3, 4, 32  # 8 optimizer steps per epoch, 24 in all


def data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=g))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        # Momentum: a resume that lost the optimizer's state would give other losses.
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class LossLog(L.Callback):
    def __init__(self, path: str, io: EttkitCheckpointIO, kill_step: int | None) -> None:
        self.path, self.io, self.kill_step = path, io, kill_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": outputs["loss"].item()}) + "\n")
        if trainer.global_step == self.kill_step:
            self.io.checkpointer.wait()  # the saves so far are durable: the crash loses only what follows
            ett.current().flush()  # and the ledger holds every step done, so the report's figures are fixed
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    run_dir = sys.argv[1]
    kill_step = int(sys.argv[2]) if len(sys.argv) > 2 else None
    io = EttkitCheckpointIO(os.path.join(run_dir, "ckpt"), keep_last=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS, plugins=[io], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                        callbacks=[EttCallback(run_dir),
                                   ModelCheckpoint(dirpath=os.path.join(run_dir, "lightning"), every_n_epochs=1,
                                                   save_top_k=-1),
                                   LossLog(os.path.join(run_dir, "losses.jsonl"), io, kill_step)])
    trainer.fit(Regression(), DataLoader(data(1, SAMPLES), batch_size=BATCH),
                DataLoader(data(2, 8), batch_size=BATCH), ckpt_path=io.resume_path())


if __name__ == "__main__":
    main()
