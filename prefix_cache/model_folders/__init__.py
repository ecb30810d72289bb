"""Model folders, read or made offline: where tokenizers and chat templates come from.

``model_dir.py`` (a model folder's tokenizer and chat template), ``tokenizer_folders.py``
(tokenizer folders built from installed packages, a disk cache), ``demo.py`` (the demo model
folder), ``file_lock.py`` (one writer at a time for the folders made on first use).
"""
