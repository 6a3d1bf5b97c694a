"""A tiny PyTorch Lightning job (DDP over gloo on CPU) with the clusterwatch callback, under torchrun.

With ``--unmodified`` it runs no clusterwatch code of its own (no import, no
callback): what ``clusterwatch run`` must watch as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopAtStepInFile(pl.Callback):
    """Stop after the step the test writes into ``path``: every rank at the same step."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.path is not None and self.path.exists() and trainer.global_step >= int(self.path.read_text()):
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--until-file", type=Path)
    parser.add_argument("--unmodified", action="store_true")
    args = parser.parse_args()
    callbacks: list[pl.Callback] = [StopAtStepInFile(args.until_file)]
    resume_from = None
    if not args.unmodified:
        from clusterwatch.hook.lightning import ClusterwatchCallback

        callback = ClusterwatchCallback(job="lightning-job", checkpoint_dir=str(args.out_dir / "checkpoints"))
        callbacks.insert(0, callback)
        resume_from = callback.resume_checkpoint_path()
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=args.max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.out_dir),
        callbacks=callbacks,
    )
    trainer.fit(TinyModel(), DataLoader(data, batch_size=16), ckpt_path=resume_from)
    out = {"rank": trainer.global_rank, "global_step": trainer.global_step}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
