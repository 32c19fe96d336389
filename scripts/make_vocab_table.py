"""Build the token-frequency table the trimmed draft head uses (engine/models/vocab.py) and write it to assets/vocab/.

    python -m scripts.make_vocab_table                 # the default pair's tokenizer (the converted model's)
    python -m scripts.make_vocab_table --tokenizer DIR # any saved Hugging Face tokenizer

The text is what any Python install carries: pydoc's topic texts (English prose about Python) and the standard
library's sources, read in a fixed order. Prompts the benchmark uses are deliberately not part of it. The table keeps
the ids only (most frequent first, at most --keep), in a file named by the tokenizer's fingerprint, so the engine
finds it for exactly this vocabulary.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path


from engine.models.vocab import ASSETS, build_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the converted default target's)")
    parser.add_argument("--keep", type=int, default=32768, help="ids kept, most frequent first")
    parser.add_argument("--out", type=Path, default=ASSETS)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    if args.tokenizer:
        source = args.tokenizer
    else:
        from engine.models import packaged_model_dir
        source = packaged_model_dir("default-target")
    tokenizer = AutoTokenizer.from_pretrained(source)
    start = time.perf_counter()
    table = build_table(tokenizer, keep=args.keep)
    table["python"] = platform.python_version()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{table['fingerprint']}.json"
    out.write_text(json.dumps(table, separators=(",", ":")))
    print(f"wrote {out}: {len(table['ids'])} ids from a {table['vocab_size']}-token vocabulary in "
          f"{time.perf_counter() - start:.0f} s ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
