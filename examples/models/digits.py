"""The `digits_cnn` network, its data split and its training.

Data: scikit-learn's bundled digits (1,797 images of 8×8 ink counts, 0..16, ink high). The split is fixed:
`train_test_split(test_size=0.2, stratify=labels, random_state=SPLIT_SEED)` with `SPLIT_SEED = 0`, which
gives 1,437 training and 360 held-out images with the same class proportions. Everything outside training
(the end-to-end tests, the accuracy figures) measures on the held-out part only.

The model takes the ink counts as they are (0..16, float32, [N, 1, 8, 8]) and scales them itself, so the
preprocess stage, `load_split` and the model all speak the same units.

`python -m examples.models.build` (`make model`) trains it and writes it into the model repository as
TorchScript, `digits_cnn/1/model.pt`, served by the model service like any user's model.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

MODEL_NAME = "digits_cnn"
NUM_CLASSES = 10
#: Ink count of a full 4×4 block in the original 32×32 bitmaps: the top of the input range.
INK_MAX = 16.0
#: Seed of the train/test split; changing it changes which images are held out.
SPLIT_SEED = 0
TEST_FRACTION = 0.2
DEFAULT_EPOCHS = 40


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions and a linear layer: [N, 1, 8, 8] ink counts (0..16) → [N, 10] logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 4 * 4, NUM_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of ink-count images."""
        return self.classifier(self.features(x * (1.0 / INK_MAX)))


@functools.cache
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32).reshape(-1, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=TEST_FRACTION, stratify=labels, random_state=SPLIT_SEED
    )
    for array in (x_train, x_test, y_train, y_test):
        array.flags.writeable = False
    return x_train, y_train, x_test, y_test


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed split of scikit-learn's digits: `(x_train, y_train, x_test, y_test)`.

    Images are float32 [N, 1, 8, 8] in raw ink counts 0..16 (the model's input units, no normalisation);
    labels are int64 [N]. 1,437 training and 360 held-out images, stratified, seed `SPLIT_SEED`.
    """
    x_train, y_train, x_test, y_test = _split()
    return x_train.copy(), y_train.copy(), x_test.copy(), y_test.copy()


@dataclass(frozen=True, slots=True)
class TrainReport:
    """What one training run produced."""

    test_accuracy: float
    train_accuracy: float
    epochs: int
    seed: int
    seconds: float


def train(
    *,
    epochs: int = DEFAULT_EPOCHS,
    seed: int = 0,
    progress: bool = True,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
) -> tuple[DigitsCNN, TrainReport]:
    """Train `DigitsCNN` on the training split; returns the network in eval mode and what the run measured.

    Deterministic for a given seed on CPU: the same seed gives the same weights, bit for bit. Runs on one
    thread, which is also the fastest for a network this small. The global torch RNG, thread count and
    determinism setting are left as found.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    from tqdm import tqdm

    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in load_split())
    started = time.perf_counter()
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DigitsCNN()
            optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
            shuffle = torch.Generator().manual_seed(seed)
            loss_fn = nn.CrossEntropyLoss()
            bar = tqdm(range(epochs), desc="training digits_cnn", unit="epoch", disable=not progress)
            for _ in bar:
                model.train()
                order = torch.randperm(len(x_train), generator=shuffle)
                total = 0.0
                for start in range(0, len(order), batch_size):
                    batch = order[start : start + batch_size]
                    optimizer.zero_grad(set_to_none=True)
                    loss = loss_fn(model(x_train[batch]), y_train[batch])
                    loss.backward()
                    optimizer.step()
                    total += loss.item() * len(batch)
                schedule.step()
                bar.set_postfix(loss=f"{total / len(x_train):.4f}")
            model.eval()
            train_accuracy = accuracy(model, x_train, y_train)
            test_accuracy = accuracy(model, x_test, y_test)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    report = TrainReport(
        test_accuracy=test_accuracy,
        train_accuracy=train_accuracy,
        epochs=epochs,
        seed=seed,
        seconds=time.perf_counter() - started,
    )
    return model, report


@torch.inference_mode()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of `images` that `model` (in eval mode) labels correctly."""
    return float((model(images).argmax(dim=1) == labels).float().mean())
