"""Model loading for tree speculative decoding, by concern:

  pair.py      ModelPair, end-of-sequence ids, and the refusals (caches that cannot roll back, mismatched vocabularies)
  devices.py   device and dtype resolution, and the pair's captured-steps switch (`capture_backend`)
  tiny.py      tiny random Qwen2 pairs with a byte-level tokenizer, built in memory (tests, demos)
  packaged.py  the offline default pair: GGUF chunks in pip packages -> verified .gguf -> cached safetensors
  loading.py   one model from a spec, and `load_pair`, which loads, checks, prepares kernels and measures costs
  progress.py  the progress callback that slow loads share
  vocab.py     the draft's trimmed vocabulary head (`--draft-vocab`)
  checkpoint.py  plain weights mapped back from a model's checkpoint after a format freed them (the bench's AR)

May import: training (adapters), the CPU room (its formats and packages, prepared at load), measure and the core
(contract `engine-rooms`).
Import from here: `from engine.models import load_pair, ModelPair, tiny_random_pair`.
"""
from engine.models.devices import resolve_device, resolve_dtype
from engine.models.loading import PAIRS, load_model, load_pair, prepare_kernels
from engine.models.packaged import (PACKAGED, PackagedModel, assemble_chunks, convert_gguf, copy_in_dtype,
                                    find_chunks, is_converted, packaged_model_dir, prepared_model_dir,
                                    require_gguf_support)
from engine.models.pair import ModelLoadError, ModelPair, check_rollbackable, check_same_vocab, eos_token_ids
from engine.models.progress import Progress
from engine.models.tiny import tiny_config, tiny_random_model, tiny_random_pair, tiny_tokenizer

__all__ = [
    "PACKAGED", "PAIRS", "ModelLoadError", "ModelPair", "PackagedModel", "Progress", "assemble_chunks",
    "check_rollbackable", "check_same_vocab", "convert_gguf", "copy_in_dtype", "eos_token_ids", "find_chunks",
    "is_converted", "load_model", "load_pair", "packaged_model_dir", "prepare_kernels", "prepared_model_dir",
    "require_gguf_support", "resolve_device", "resolve_dtype", "tiny_config", "tiny_random_model", "tiny_random_pair",
    "tiny_tokenizer",
]
