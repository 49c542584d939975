"""A Lightning run checkpointed by ettkit and measured by its ETT recorder (docs/integrations.md).

python examples/python/lightning_ettkit.py RUN_DIR       # run it again after a kill: it resumes
ettkit report RUN_DIR                                      # where the run's time went
"""

import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ettkit.integrations.lightning import EttCallback, EttkitCheckpointIO


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    run_dir = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
    io = EttkitCheckpointIO(f"{run_dir}/ckpt", keep_last=2)           # saves return before the write
    trainer = L.Trainer(max_epochs=5, accelerator="cpu", plugins=[io], logger=False,
                        callbacks=[EttCallback(run_dir), ModelCheckpoint(every_n_epochs=1)])
    trainer.fit(Classifier(), DataLoader(data, batch_size=64), ckpt_path=io.resume_path())
