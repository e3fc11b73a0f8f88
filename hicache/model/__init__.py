"""The model (docs/DESIGN.md, "model family"): what the engine needs of one (base.py), and four rooms
behind it, each importing only the rooms below it:

- loading/: `--model` and draft names, checkpoints (GGUF, Hugging Face directories) and their checks;
- families/: the decoders (Llama, MLA, token-shift) and the built-in models;
- attention/: the attention backends (local, CP-gathered) and the CP page gather;
- kernels/: the batch-invariant ops, their calibration and start-up self-check, quantized weights,
  TP's fixed groups.

The modules here are what every room shares (the config, RoPE and its scaling, the step's batch,
tokenizers, chat templates) and build.py, which builds one rank's decoder from all of them.
"""
