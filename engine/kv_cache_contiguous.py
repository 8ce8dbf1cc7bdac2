"""The unpaged KV cache of one sequence: per layer, one growing [S, kv_dim] tensor.

It implements `engine.model.KvCache` for batches that hold a single sequence (q_lens of length
1). It is the cache of `reference_generate`, the path every paged runtime is compared against,
so it is deliberately simple: each update concatenates (O(S) copy per step and layer).
"""

from __future__ import annotations

import torch


class ContiguousKvCache:
    """Latents of one sequence for `num_layers` KV layers (use `config.num_kv_layers` to
    include the MTP layers)."""

    def __init__(self, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers={num_layers}: must be positive")
        self._layers: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def seq_len(self, layer: int = 0) -> int:
        """Tokens cached in `layer` (rows 0..seq_len-1 hold positions 0..seq_len-1)."""
        t = self._layers[layer]
        return 0 if t is None else t.shape[0]

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        """Append latent [T, kv_dim] to `layer`; return [context [S, kv_dim]] (one sequence).

        Raises IndexError for a layer outside 0..num_layers-1, ValueError for a latent whose
        width or dtype differs from what the layer already holds.
        """
        if not 0 <= layer < len(self._layers):
            raise IndexError(f"KV layer {layer} of {len(self._layers)}")
        past = self._layers[layer]
        if past is None:
            ctx = latent.detach().clone()  # own the storage: callers may reuse their buffers
        else:
            if latent.shape[1:] != past.shape[1:] or latent.dtype != past.dtype:
                raise ValueError(f"layer {layer}: latent {tuple(latent.shape)} {latent.dtype} "
                                 f"does not match cached {tuple(past.shape)} {past.dtype}")
            ctx = torch.cat((past, latent.detach()), dim=0)
        self._layers[layer] = ctx
        return [ctx]

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first `num_tokens` rows of every layer (drop rejected draft tokens)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
        self._layers = [None if t is None or num_tokens == 0 else t[:num_tokens]
                        for t in self._layers]
