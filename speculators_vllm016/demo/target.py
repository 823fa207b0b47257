"""The demo's target model: the tiny random Llama, trained briefly on the shipped conversations.

A random target's next-token distributions are noise; no draft can learn to predict noise, so the
demo first teaches the target the conversations (plain causal-LM training over the chat-template
rendering of each conversation, packed into fixed-length rows). Seeded and deterministic on one
machine; the result is written whole (into a hidden folder, then renamed), so a rerun reuses it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from speculators_vllm016.utils.atomic_files import give_usual_modes
from speculators_vllm016.utils.errors import InvalidInputError

__all__ = ["TargetTraining", "TargetTrainingResult", "render_conversations", "train_demo_target"]

RESULT_FILE = "demo_target_training.json"


@dataclass
class TargetTraining:
    """How the demo target is trained."""

    steps: int = 60
    row_tokens: int = 256
    rows_per_step: int = 8
    lr: float = 3e-3
    seed: int = 0
    max_conversations: int | None = None
    show_progress: bool = True


@dataclass
class TargetTrainingResult:
    path: Path
    steps: int
    tokens: int  # tokens trained on (steps x rows x row length)
    seconds: float
    first_loss: float
    last_loss: float
    reused: bool = False

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def render_conversations(tokenizer, path: str | Path, limit: int | None = None) -> list[list[int]]:
    """Token ids of each conversation (datagen's row shapes), rendered with the chat template."""
    from speculators_vllm016.demo import read_conversations

    rendered = []
    for messages in read_conversations(path):
        if limit is not None and len(rendered) >= limit:
            break
        rendered.append(list(tokenizer.apply_chat_template(messages, tokenize=True)))
    return rendered


def _rows(conversations: list[list[int]], row_tokens: int) -> list[list[int]]:
    """One token stream cut into rows of `row_tokens` (the model shifts the labels itself)."""
    stream = [token for ids in conversations for token in ids]
    return [stream[i : i + row_tokens] for i in range(0, len(stream) - row_tokens + 1, row_tokens)]


def train_demo_target(
    initial: str | Path, output: str | Path, data_path: str | Path, options: TargetTraining
) -> TargetTrainingResult:
    """Train the model in `initial` and save it (with its tokenizer) to `output`; reuse `output`."""
    output = Path(output)
    record = output / RESULT_FILE
    if record.is_file():
        saved = json.loads(record.read_text())
        return TargetTrainingResult(path=output, reused=True, **saved)

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(options.seed)
    tokenizer = AutoTokenizer.from_pretrained(initial)
    model = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32)
    model.train()
    rows = torch.tensor(
        _rows(
            render_conversations(tokenizer, data_path, options.max_conversations),
            options.row_tokens,
        )
    )
    if len(rows) < options.rows_per_step:
        raise InvalidInputError(
            f"the conversations fill {len(rows)} rows of {options.row_tokens} tokens; "
            f"lower the row length or the rows per step ({options.rows_per_step})"
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=0.0)
    warmup = max(1, options.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(step, options.steps) / options.steps))
        ),
    )
    generator = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(len(rows), generator=generator)
    cursor, losses = 0, []
    started = time.perf_counter()
    bar = tqdm(
        total=options.steps, desc="target: training", unit="step", disable=not options.show_progress
    )
    for _ in range(options.steps):
        if cursor + options.rows_per_step > len(order):
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        batch = rows[order[cursor : cursor + options.rows_per_step]]
        cursor += options.rows_per_step
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    seconds = time.perf_counter() - started

    result = TargetTrainingResult(
        path=output,
        steps=options.steps,
        tokens=options.steps * options.rows_per_step * options.row_tokens,
        seconds=seconds,
        first_loss=losses[0],
        last_loss=losses[-1],
    )
    temporary = output.with_name(f".{output.name}.partial")
    shutil.rmtree(temporary, ignore_errors=True)
    model.eval()
    model.save_pretrained(temporary, safe_serialization=True)
    tokenizer.save_pretrained(temporary)
    saved = {k: v for k, v in vars(result).items() if k not in ("path", "reused")}
    (temporary / RESULT_FILE).write_text(json.dumps(saved, indent=2) + "\n")
    give_usual_modes(temporary)
    shutil.rmtree(output, ignore_errors=True)
    temporary.rename(output)
    return result
