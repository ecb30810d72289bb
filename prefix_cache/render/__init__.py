"""Rendering and tokenizing with the caller's own tokenizer and chat template.

``render.py`` (the renderer, to text or ids, and the render's identity), ``split.py`` (a
tokenizer's safe-split rule and the search for a split in a static text),
``tokenizer_identity.py`` (the tokenizer's fingerprint in the key), ``tokenizer_model.py`` (one
model of a tokenizer that the split, the renderer and the tail pieces read). Its own part, used by
``render.py`` alone: ``_template_clock.py`` (what a template reads from the clock or randomness,
and the key's time tag).
"""
