"""A tiny Hugging Face Trainer job (model built from a config, no downloads) with the clusterwatch callback.

With ``--unmodified`` it runs no clusterwatch code of its own (no import, no
callback): what ``clusterwatch run`` must watch as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {
            "input_ids": torch.randint(0, 100, (16,), generator=generator),
            "labels": torch.tensor(index % 2),
        }


class StopAtStepInFile(TrainerCallback):
    """Stop after the step the test writes into ``path``: every rank at the same step."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.path is not None and self.path.exists() and state.global_step >= int(self.path.read_text()):
            control.should_training_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--until-file", type=Path)
    parser.add_argument("--unmodified", action="store_true")
    args = parser.parse_args()
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    output_dir = str(args.out_dir / "hf")
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks: list[TrainerCallback] = [StopAtStepInFile(args.until_file)]
    resume_from = None
    if not args.unmodified:
        from clusterwatch.hook.transformers import ClusterwatchCallback

        callback = ClusterwatchCallback(job="hf-job")
        callbacks.insert(0, callback)
        resume_from = callback.resume_checkpoint_path(output_dir)
    trainer = Trainer(
        model=BertForSequenceClassification(config),
        args=training_args,
        train_dataset=RandomTokens(),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume_from)
    rank = trainer.args.process_index
    out = {"rank": rank, "global_step": trainer.state.global_step}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
