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


class GGUFGemma3(GGUFLlama):
    """A Gemma 3 GGUF as numpy weights, run the way llama.cpp runs it (``llm_build_gemma3``):
    norms multiply by the stored weight (the +1 already in it), Q and K normed per head and
    turned by NEOX rotation (the two halves of a head), every sixth layer global and the others
    seeing the last ``sliding_window`` positions with their own rotary base, embeddings scaled
    by sqrt(hidden), the tanh GELU, and the output tied to the embeddings."""

    SWA_PATTERN = 6
    SWA_BASE = 10_000.0

    def _w(self, name: str) -> np.ndarray:
        # float32, as dequantized: a 262,144-token embedding in float64 costs 1.3 GB a copy,
        # and float32 through 18 layers stays well inside the test's tolerance.
        return self.tensor(name)

    def __init__(self, path: Path) -> None:  # noqa: D107 - the fields differ from llama's
        from gguf import GGUFReader

        self._reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._cache = {}
        self.layers = int(self.field("gemma3.block_count"))
        self.heads = int(self.field("gemma3.attention.head_count"))
        self.kv_heads = int(self.field("gemma3.attention.head_count_kv"))
        self.head_dim = int(self.field("gemma3.attention.key_length"))
        self.eps = float(self.field("gemma3.attention.layer_norm_rms_epsilon"))
        self.base = float(self.field("gemma3.rope.freq_base"))
        self.window = int(self.field("gemma3.attention.sliding_window"))
        self.hidden = int(self.field("gemma3.embedding_length"))

    @staticmethod
    def _rope_neox(x: np.ndarray, base: float) -> np.ndarray:
        n, _, d = x.shape
        theta = base ** (-np.arange(0, d, 2) / d)
        angle = np.arange(n)[:, None, None] * theta[None, None, :]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                               a * np.sin(angle) + b * np.cos(angle)], axis=-1)

    def logits(self, ids: list[int], layers: int | None = None,  # type: ignore[override]
               embed_scale: float | None = None, window: int | None = None,
               last: int | None = None) -> np.ndarray:
        """(len(ids), vocab) logits, or the ``last`` rows only; ``embed_scale`` replaces
        sqrt(hidden), ``window`` the sliding window (to show a wrong one changes the answer)."""
        n = len(ids)
        window = window or self.window
        x = self._w("token_embd.weight")[ids] * (embed_scale or np.sqrt(self.hidden))
        group = self.heads // self.kv_heads
        pos = np.arange(n)
        causal = np.where(pos[None, :] > pos[:, None], -np.inf, 0.0)
        local = np.where(pos[:, None] - pos[None, :] >= window, -np.inf, causal)
        for i in range(self.layers if layers is None else layers):
            p = f"blk.{i}."
            is_global = i % self.SWA_PATTERN == self.SWA_PATTERN - 1
            base, mask = (self.base, causal) if is_global else (self.SWA_BASE, local)
            h = self._rms(x, p + "attn_norm.weight")
            q = (h @ self._w(p + "attn_q.weight").T).reshape(n, self.heads, -1)
            k = (h @ self._w(p + "attn_k.weight").T).reshape(n, self.kv_heads, -1)
            v = (h @ self._w(p + "attn_v.weight").T).reshape(n, self.kv_heads, -1)
            q = self._rope_neox(self._rms(q, p + "attn_q_norm.weight"), base)
            k = self._rope_neox(self._rms(k, p + "attn_k_norm.weight"), base)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            # (heads, n, d) @ (heads, d, n): BLAS, not einsum's loops
            scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0) / np.sqrt(self.head_dim) + mask
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            attn = (weights @ v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(n, -1)
            x = x + self._rms(attn @ self._w(p + "attn_output.weight").T,
                              p + "post_attention_norm.weight")
            h = self._rms(x, p + "ffn_norm.weight")
            gate = h @ self._w(p + "ffn_gate.weight").T
            gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
            up = h @ self._w(p + "ffn_up.weight").T
            x = x + self._rms((gelu * up) @ self._w(p + "ffn_down.weight").T,
                              p + "post_ffw_norm.weight")
        x = self._rms(x[-(last or n):], "output_norm.weight")
        return x @ self._w("token_embd.weight").T
