"""A deterministic encoder for the serving tests: no model needed, the same vectors in every process."""

import zlib

import numpy as np


class FixedEncoder:
    """Unit vectors per text, seeded by the text's CRC-32 (the same in every process, unlike `hash`). With
    `max_tokens` it says, as covlab.serving's Encoder does, how many tokens of a text it reads."""

    def __init__(self, dim: int = 8, max_tokens: int | None = None):
        self.dim, self.table = dim, {}
        if max_tokens is not None:
            self.max_tokens = max_tokens

    def __call__(self, texts):
        rows = []
        for text in texts:
            if text not in self.table:
                vector = np.random.default_rng(zlib.crc32(text.encode())).standard_normal(self.dim)
                self.table[text] = vector / np.linalg.norm(vector)
            rows.append(self.table[text])
        return np.stack(rows)
