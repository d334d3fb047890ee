"""A tiny Hugging Face Trainer job (random-init 1-layer GPT-2, no downloads) for the integration
test. With ``--babysit`` it trains through ``hf_train(trainer)``; without, ``trainer.train()``.

The data: sequences ``(a + k * s) mod 64`` (learnable), read in order (sequential sampler), so
optimizer step ``g`` of a 2-rank job trains on items ``[8g, 8g + 8)``. ``--poison A:B`` gives the
items of steps ``A <= g < B`` labels of pure noise: a loss spike that lasts as long as they do.
``--at ATTEMPT:RANK:STEP:WHAT`` (repeatable): on that attempt, just before that optimizer step
(``on_step_begin``), that rank sends itself the signal ``WHAT`` (``SIGKILL``, ``SIGSEGV``...).
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--poison", default=None)
parser.add_argument("--babysit", action="store_true")
parser.add_argument("--at", action="append", default=[])
args = parser.parse_args()

BATCH, LENGTH, VOCAB = 4, 16, 64
world = int(os.environ.get("WORLD_SIZE", "1"))
poison = tuple(int(v) for v in args.poison.split(":")) if args.poison else None


class Sequences(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return (args.steps + 30) * world * BATCH  # room for the batches a rollback skips

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        a = int(torch.randint(0, VOCAB, (1,), generator=g))
        s = int(torch.randint(1, 4, (1,), generator=g))
        ids = (a + s * torch.arange(LENGTH)) % VOCAB
        if poison and poison[0] <= i // (world * BATCH) < poison[1]:  # labels of pure noise
            return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (LENGTH,), generator=g)}
        return {"input_ids": ids, "labels": ids.clone()}


def faults() -> dict[int, str]:
    """``--at``: this rank's faults of this attempt, by step (babysit's directive says which
    attempt this is: read once training runs, as a warm standby's is written at promotion)."""
    directive = os.environ.get("BABYSIT_DIRECTIVE")
    attempt = json.loads(Path(directive).read_text())["attempt"] if directive else 0
    rank = int(os.environ.get("RANK", "0"))
    return {int(s): what for a, r, s, what in (f.split(":") for f in args.at)
            if int(a) == attempt and int(r) == rank}


class Faults(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.at = faults()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        what = self.at.get(state.global_step + 1)
        if what is not None:
            print(f"rank {os.environ.get('RANK')}: injected {what} at step "
                  f"{state.global_step + 1}", flush=True)
            os.kill(os.getpid(), getattr(signal, what))


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=VOCAB,
                                   n_positions=LENGTH))
training = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=BATCH,
    learning_rate=1e-2, warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
    use_cpu=True, disable_tqdm=True, train_sampling_strategy="sequential", seed=0,
    dataloader_num_workers=0)
trainer = Trainer(model=model, args=training, train_dataset=Sequences(),
                  callbacks=[Faults()] if args.at else [])
if args.babysit:
    from babysit.integrations import hf_train

    hf_train(trainer)
else:
    trainer.train()
if int(os.environ.get("RANK", "0")) == 0:
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print("FINAL " + json.dumps({"loss": sum(losses[-5:]) / 5, "step": trainer.state.global_step}),
          flush=True)
