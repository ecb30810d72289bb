"""An independent llama forward pass straight from a GGUF file, in numpy (float64), to check the
converter against.

Nothing of the converter's code path is shared: the tensors are read and dequantized by
llama.cpp's own ``gguf`` package (not ``mx.load``), Q and K stay as GGUF stores them (rows
permuted for ggml's rotary convention) and are rotated the way ggml's RoPE does it for llama
(mode 0: adjacent pairs of dimensions), and the hyperparameters come from the GGUF's fields. The
converter instead un-permutes the rows and runs mlx-lm's llama, which rotates the two halves of
each head; both must give the same logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class GGUFLlama:
    """A llama GGUF as numpy weights; ``logits(ids)`` runs the model over a prompt."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self._reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._cache: dict[str, np.ndarray] = {}
        self.layers = int(self.field("llama.block_count"))
        self.heads = int(self.field("llama.attention.head_count"))
        self.kv_heads = int(self.field("llama.attention.head_count_kv"))
        self.eps = float(self.field("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(self.field("llama.rope.freq_base"))

    def field(self, key: str) -> Any:
        f = self._reader.fields[key]
        return f.parts[f.data[0]][0]

    def tensor(self, name: str) -> np.ndarray:
        """A tensor dequantized by gguf, (rows, columns) as ggml lays out (out, in)."""
        if name not in self._cache:
            from gguf.quants import dequantize

            t = self._tensors[name]
            self._cache[name] = dequantize(t.data, t.tensor_type).astype(np.float32)
        return self._cache[name]

    def _w(self, name: str) -> np.ndarray:
        return self.tensor(name).astype(np.float64)

    def _rms(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self._w(name)

    def _rope_ggml(self, x: np.ndarray) -> np.ndarray:
        """ggml's llama RoPE: dimensions (2i, 2i+1) turned by pos * base^(-2i/d)."""
        n, _, d = x.shape
        theta = self.base ** (-np.arange(0, d, 2) / d)                  # (d/2,)
        angle = np.arange(n)[:, None, None] * theta[None, None, :]      # (n, 1, d/2)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
        out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
        return out

    def logits(self, ids: list[int], layers: int | None = None,
               rope: Any = None) -> np.ndarray:
        """(len(ids), vocab) logits; ``layers`` runs only the first ones (a truncated copy);
        ``rope`` replaces the rotation (to show a wrong convention changes the answer)."""
        rope = rope or self._rope_ggml
        n = len(ids)
        x = self._w("token_embd.weight")[ids]
        group = self.heads // self.kv_heads
        causal = np.triu(np.full((n, n), -np.inf), 1)
        for i in range(self.layers if layers is None else layers):
            p = f"blk.{i}."
            h = self._rms(x, p + "attn_norm.weight")
            q = (h @ self._w(p + "attn_q.weight").T).reshape(n, self.heads, -1)
            k = (h @ self._w(p + "attn_k.weight").T).reshape(n, self.kv_heads, -1)
            v = (h @ self._w(p + "attn_v.weight").T).reshape(n, self.kv_heads, -1)
            q, k = rope(q), rope(k)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]) + causal
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", weights, v).reshape(n, -1)
            x = x + attn @ self._w(p + "attn_output.weight").T
            h = self._rms(x, p + "ffn_norm.weight")
            gate = h @ self._w(p + "ffn_gate.weight").T
            up = h @ self._w(p + "ffn_up.weight").T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self._w(p + "ffn_down.weight").T
        x = self._rms(x, "output_norm.weight")
        head = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
        return x @ self._w(head).T


def rope_halves(base: float) -> Any:
    """Hugging Face's rotation (the two halves of each head): wrong on GGUF's permuted rows."""

    def rotate(x: np.ndarray) -> np.ndarray:
        n, _, d = x.shape
        theta = base ** (-np.arange(0, d, 2) / d)
        angle = np.arange(n)[:, None, None] * theta[None, None, :]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                               a * np.sin(angle) + b * np.cos(angle)], axis=-1)

    return rotate
