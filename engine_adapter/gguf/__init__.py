"""GGUF files as mlx-lm model folders: ``engine_adapter.gguf.convert.convert_gguf(source,
dest)`` (imports mlx), ``llama`` (config and weights), ``tokenizer`` (the tokenizer files)."""
