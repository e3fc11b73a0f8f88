"""Loading (docs/DESIGN.md, "model family"): a `--model` or draft name to a LoadedModel (loader.py,
draft.py), from a GGUF file (gguf_loader.py) or a Hugging Face directory (hf_loader.py), checked
against what its config implies (checkpoint.py)."""
