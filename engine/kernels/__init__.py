"""Kernels of the decode hot path, each beside a plain-torch reference that defines what it
computes (tests compare the two over shapes):

- `mla_decode.py`: paged MLA decode attention over the compressed latent pool (Triton, split-KV
  flash-decoding; reference: `mla_decode_reference`).
- `grouped_experts.py`: a MoE layer's routed experts as grouped GEMMs over the step's tokens
  sorted by expert (`torch.nn.functional.grouped_mm`; reference: `MoE.experts_forward`'s loop).
"""
