"""The demo's target model: the tiny random Llama, trained briefly on the shipped conversations.

A random target's next-token distributions are noise; no draft can learn to predict noise, so the
demo first teaches the target the conversations (plain causal-LM training over the chat-template
rendering of each conversation). Seeded and deterministic on one machine; the result is written
whole (into a hidden folder, then renamed), so a rerun reuses it.

Two kinds of rows:

- short rows (`row_tokens`, `rows_per_step` of them a step), cut one after the other from one
  token stream of the rendered conversations;
- long rows (`long_row_tokens`, one every `long_every`-th step instead of the short rows):
  sessions of the conversations' user/assistant pairs chained into one chat
  (`data_generation.sessions`, the shape of the long prompts `--long-context` serves), each
  starting at position 0 as a prompt does.

A target taught on short rows only has never seen a position past them: at ~1,750-token prompts
the demo's target ended its answers after 7.5 tokens on average (32 at short prompts), and every
draft's acceptance fell with it (#46). Long rows cut from the stream instead (`row_tokens` 2048,
one a step) removed that fall but answered 60 of 160 short regeneration prompts with nothing (in
such rows a conversation's first token is almost never at position 0, where every prompt puts
it). With the session rows beside the stream rows both drafts keep their tau at ~1,730-token
prompts and no regeneration is empty; short rows from each conversation's start instead of the
stream measured worse at the long prompts (docs/evaluation.md).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
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
    long_row_tokens: int = 0
    """Tokens of the long rows (sessions of chained pairs); 0: short rows only."""
    long_every: int = 4
    """Every `long_every`-th step trains on one long row instead of the short rows."""
    lr: float = 3e-3
    seed: int = 0
    max_conversations: int | None = None
    show_progress: bool = True


@dataclass
class TargetTrainingResult:
    path: Path
    steps: int
    tokens: int  # tokens trained on, short and long rows
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


def stream_rows(conversations: list[list[int]], row_tokens: int) -> list[list[int]]:
    """One token stream cut into rows of `row_tokens` (the model shifts the labels itself)."""
    stream = [token for ids in conversations for token in ids]
    return [stream[i : i + row_tokens] for i in range(0, len(stream) - row_tokens + 1, row_tokens)]


def session_rows(
    tokenizer, path: str | Path, length: int, limit: int | None = None
) -> list[list[int]]:
    """The conversations' user/assistant pairs chained into sessions of at most `length` tokens
    (`data_generation.sessions.assemble_sessions`, as `datagen --session-tokens` chains them),
    each rendered whole: the long prompts' shape."""
    from speculators_vllm016.data_generation.sessions import assemble_sessions
    from speculators_vllm016.demo import read_conversations

    conversations = list(read_conversations(path))[:limit]

    def render(messages: list[dict[str, str]]) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, tokenize=True))

    return [render(session) for session in assemble_sessions(conversations, render, length)]


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
    conversations = render_conversations(tokenizer, data_path, options.max_conversations)
    rows = torch.tensor(stream_rows(conversations, options.row_tokens))
    if len(rows) < options.rows_per_step:
        raise InvalidInputError(
            f"the conversations fill {len(rows)} rows of {options.row_tokens} tokens; "
            f"lower the row length or the rows per step ({options.rows_per_step})"
        )
    long_rows = []
    if options.long_row_tokens:
        long_rows = [
            torch.tensor([ids])
            for ids in session_rows(
                tokenizer, data_path, options.long_row_tokens, options.max_conversations
            )
        ]
        if not long_rows:
            raise InvalidInputError(
                f"no session of {options.long_row_tokens} tokens can be chained from the "
                f"conversations; lower the long row length"
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
    batches = _step_batches(rows, long_rows, options, generator)
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    bar = tqdm(
        total=options.steps, desc="target: training", unit="step", disable=not options.show_progress
    )
    for batch in batches:
        tokens += batch.numel()
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
        tokens=tokens,
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


def _step_batches(rows, long_rows: list, options: TargetTraining, generator) -> Iterator:
    """Each step's batch: `rows_per_step` short rows (a new shuffled pass over them when they run
    out), every `long_every`-th step one long row instead (likewise shuffled), when there are
    long rows. Deterministic for a seeded `generator`."""
    import torch

    order, cursor = torch.randperm(len(rows), generator=generator), 0
    long_order, long_cursor = [], 0
    for step in range(options.steps):
        if long_rows and (step + 1) % options.long_every == 0:
            if long_cursor == len(long_order):
                long_order, long_cursor = torch.randperm(len(long_rows), generator=generator), 0
            yield long_rows[long_order[long_cursor]]
            long_cursor += 1
            continue
        if cursor + options.rows_per_step > len(order):
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        yield rows[order[cursor : cursor + options.rows_per_step]]
        cursor += options.rows_per_step
