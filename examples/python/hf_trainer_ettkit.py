"""A Hugging Face Trainer run saved and resumed by ettkit, then exported for from_pretrained
(docs/integrations.md). Nothing is downloaded: the model is a small GPT-2 built from a config.

python examples/python/hf_trainer_ettkit.py RUN_DIR      # run it again after a kill: it resumes
ettkit report RUN_DIR
"""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from ettkit.checkpoint import latest_step
from ettkit.integrations.hf_export import export_hf
from ettkit.integrations.hf_trainer import EttkitTrainerCallback


class RandomText(torch.utils.data.Dataset):
    def __init__(self, n=512, length=64, vocab=1024):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    run_dir = sys.argv[1]
    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=64)
    cb = EttkitTrainerCallback(f"{run_dir}/ckpt", every=20, run_dir=run_dir, keep_last=2)
    args = TrainingArguments(f"{run_dir}/hf", max_steps=100, per_device_train_batch_size=16, save_strategy="no",
                             report_to=[], use_cpu=True)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=RandomText(), callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_dir())
    config.to_json_file(f"{run_dir}/config.json")
    step = latest_step(f"{run_dir}/ckpt")
    export_hf(f"{run_dir}/ckpt/step-{step}", f"{run_dir}/model", config=f"{run_dir}/config.json", overwrite=True)
    print("from_pretrained:", os.path.join(run_dir, "model"))
