"""Kernels of the decode hot path, each beside a plain-torch reference that defines what it
computes (tests compare the two over shapes):

- `mla_decode.py`: paged MLA decode attention over the compressed latent pool (Triton, split-KV
  flash-decoding; reference: `mla_decode_reference`).
- `fused_moe.py`: a MoE layer's routed experts as two Triton GEMMs over the step's (token,
  expert) pairs aligned by expert in one Triton program (reference: `MoE.experts_forward`'s
  loop; torch twins `align` and `fused_experts_reference`); `grouped_experts.py` stacks each
  layer's expert weights for it and adds the shared experts as extra experts.
- `latent_store.py`: a decode step's per-layer latent write (RMSNorm, rope, FP8 saturation), its
  queries' rope and their absorbed query (q_nope · W_UK) in one Triton launch (reference:
  `rope_latent_store_reference` = `engine.model.rope_latent` plus `engine.kv_pool.write_rows`
  plus an einsum).
- `greedy_head.py`: an all-greedy step's argmax and its log-probability in two launches spread
  over the vocabulary (reference: `greedy_reference`, torch's argmax and log_softmax).
- `moe_router.py`: a decode step's MoE routing in one Triton kernel (reference:
  `route_with_shared_reference` = `engine.model.route` plus the shared experts' slots).
- `slot_norm.py`: a MoE layer's per-slot output summed into the residual stream and the next
  RMSNorm in one Triton kernel (reference: `engine.model.add_rms_norm`).
"""
