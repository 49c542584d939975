"""The Hugging Face Trainer run of test_integration_hf_trainer.py: a tiny GPT-2 (from a ``GPT2Config``, nothing
downloaded) trained on CPU by ``transformers.Trainer``, saved and resumed through ``EttkitTrainerCallback``.

python integration_hf_trainer_worker.py RUN_DIR [KILL_STEP]

Appends ``{"step": global_step, "loss": ...}`` per optimizer step to RUN_DIR/losses.jsonl (the loss of the
step's forward, unrounded). Resumes from the newest committed ettkit step when there is one. With KILL_STEP:
once that step is done, waits until every save so far is durable and the ledger is flushed, then kills itself
with SIGKILL (a deterministic crash).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ettkit import ett
from ettkit.integrations.hf_trainer import EttkitTrainerCallback

SAVE_EVERY, MAX_STEPS, SAMPLES, BATCH = 3, 12, 32, 4  # 8 steps per epoch: the step-6 save is mid-epoch


class LoggedGPT2(GPT2LMHeadModel):
    """Keeps the loss of its last training forward, for the per-step record."""

    last_loss: float = float("nan")

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.training:
            self.last_loss = out.loss.item()
        return out


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (SAMPLES, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossLog(TrainerCallback):
    def __init__(self, path: str, saver: EttkitTrainerCallback, kill_step: int | None) -> None:
        self.path, self.saver, self.kill_step = path, saver, kill_step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, "loss": model.last_loss}) + "\n")
        if state.global_step == self.kill_step:
            self.saver.checkpointer.wait()
            ett.current().flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    run_dir = sys.argv[1]
    kill_step = int(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.manual_seed(0)
    model = LoggedGPT2(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(output_dir=os.path.join(run_dir, "hf"), max_steps=MAX_STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3, warmup_steps=2,
                             lr_scheduler_type="linear", save_strategy="no", logging_strategy="no", report_to=[],
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                             remove_unused_columns=False)  # the forward above takes **kwargs
    saver = EttkitTrainerCallback(os.path.join(run_dir, "ckpt"), every=SAVE_EVERY, run_dir=run_dir, keep_last=2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[saver, LossLog(os.path.join(run_dir, "losses.jsonl"), saver, kill_step)])
    trainer.train(resume_from_checkpoint=saver.resume_dir())


if __name__ == "__main__":
    main()
