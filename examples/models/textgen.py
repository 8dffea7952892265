"""The `textgen` ensemble's network: a character-level GRU, its corpus and its training.

Text is ASCII, one token per character: a token id is the character's code (0..127), so the tokenizer and
the detokenizer of the ensemble (`textgen_tokenize`, `textgen_detokenize` in the model repository) need no
vocabulary file, and every token is a whole character on its own. Id 0 (NUL) never comes from text: it pads
the prompts of a batch to one length and stands for "no character".

The corpus, `textgen_corpus.txt` beside this file (about 5 KB), is public-domain English: the Gettysburg
Address, the opening of the Declaration of Independence, Hamlet's "To be, or not to be" and Shakespeare's
sonnets 18 and 116. A network this small trained on so little text writes English-looking words, not
prose; the example is there to stream.

`python -m examples.models.build` (`make model`, and the first `make run`) trains it and writes it into the
model repository as TorchScript, `textgen_generate/1/model.pt`, which the decoupled Python model beside it
runs one step per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

MODEL_NAME = "textgen_generate"
CORPUS = Path(__file__).with_name("textgen_corpus.txt")
#: Token ids are ASCII codes.
VOCAB_SIZE = 128
#: The id that pads prompts and stands for no character (ASCII NUL, which text never holds).
PAD_ID = 0
EMBEDDING = 32
HIDDEN = 128
#: Characters per training window; the network sees `WINDOW` characters and predicts each next one.
WINDOW = 32
DEFAULT_STEPS = 300


class CharGRU(nn.Module):
    """Token ids [B, T] and a state [1, B, HIDDEN] → next-token logits [B, T, VOCAB_SIZE] and the new state.

    Generation calls `forward` once with a prompt (T its length), then once per token (T = 1), carrying the
    state; `initial_state` gives the state to start a batch of B streams from.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hidden_size = HIDDEN
        self.embed = nn.Embedding(VOCAB_SIZE, EMBEDDING)
        self.gru = nn.GRU(EMBEDDING, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB_SIZE)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for every position of `tokens`, and the state after the last."""
        out, state = self.gru(self.embed(tokens), state)
        return self.head(out), state

    @torch.jit.export
    def initial_state(self, batch: int) -> torch.Tensor:
        """The zero state of `batch` new streams, on the network's device."""
        weight = self.head.weight
        return torch.zeros(1, batch, self.hidden_size, dtype=weight.dtype, device=weight.device)


def encode(text: str) -> torch.Tensor:
    """`text` as token ids (int64 [len]); it must be ASCII without NUL."""
    data = text.encode("ascii")
    if b"\0" in data:
        raise ValueError("text holds NUL, which is the padding id")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def load_corpus() -> torch.Tensor:
    """The corpus as token ids."""
    return encode(CORPUS.read_text(encoding="ascii"))


@dataclass(frozen=True, slots=True)
class TrainReport:
    """What one training run produced: the mean loss (nats per character) of its first and last tenth."""

    first_loss: float
    last_loss: float
    steps: int
    seed: int
    seconds: float


def train(
    *,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
    batch_size: int = 32,
    learning_rate: float = 1e-2,
    progress: bool = True,
) -> tuple[CharGRU, TrainReport]:
    """Train `CharGRU` on random windows of the corpus; returns it in eval mode and what the run measured.

    Deterministic for a given seed on CPU, on one thread (the fastest for a network this small); the global
    torch RNG, thread count and determinism setting are left as found.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    from tqdm import tqdm

    corpus = load_corpus()
    started = time.perf_counter()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    losses: list[float] = []
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = CharGRU()
            optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
            windows = torch.Generator().manual_seed(seed)
            loss_fn = nn.CrossEntropyLoss()
            offsets = torch.arange(WINDOW + 1)
            model.train()
            bar = tqdm(range(steps), desc="training textgen_generate", unit="step", disable=not progress)
            for _ in bar:
                starts = torch.randint(0, len(corpus) - WINDOW - 1, (batch_size, 1), generator=windows)
                chunk = corpus[starts + offsets]
                logits, _ = model(chunk[:, :-1], model.initial_state(batch_size))
                loss = loss_fn(logits.reshape(-1, VOCAB_SIZE), chunk[:, 1:].reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            model.eval()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    tenth = max(1, steps // 10)
    report = TrainReport(
        first_loss=sum(losses[:tenth]) / tenth,
        last_loss=sum(losses[-tenth:]) / tenth,
        steps=steps,
        seed=seed,
        seconds=time.perf_counter() - started,
    )
    return model, report


def script(model: CharGRU) -> torch.jit.ScriptModule:
    """`model` as TorchScript, `forward` and `initial_state` both callable from the file."""
    return torch.jit.script(model.eval())
