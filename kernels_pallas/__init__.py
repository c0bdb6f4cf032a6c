"""Pallas kernels (segment attention, paged attention with eviction), each file holding its
jnp reference, input validators and block-size parameters (DESIGN.md §2.3).

The reference implementations are the CPU path; the kernels run on GPU/TPU and are tested
against the references in Pallas interpret mode on CPU. Kernels land with the
orchestration-core issue; the model's dense-mask attention
(``selforch_jax.models.transformer.attention``) is the reference they must match.

Modules (one file per kernel, each with its reference, validators and block sizes):

* :mod:`kernels_pallas.segment_attention` — ``segment_attention`` (block-sparse
  FlashAttention-2 forward and backward for prefill / training), ``segment_attention_reference``,
  ``visible_tiles`` / ``tile_skip_ratio`` (the skip pre-pass), ``BlockSizes``.
* :mod:`kernels_pallas.paged_attention` — ``paged_attention`` (decode over a paged KV pool with
  alive bits, segments and orders per slot; dead / invisible pages skipped),
  ``paged_attention_reference``, ``visible_pages`` / ``page_skip_ratio``, ``PagedBlockSizes``.
* :mod:`kernels_pallas.segment_mask` — the DESIGN.md §2 rule shared by both (``pair_visible``,
  per-tile summaries, compacted tile lists, a PASTA-shaped layout for benchmarks).
* :mod:`kernels_pallas.testing` — random segment layouts (i.i.d., packed, PASTA threads,
  PTD trees) for tests and fuzzing.

Both kernels output 0 for a query that sees no key (the references too), never NaN.
``interpret=True`` runs them on CPU; ``interpret=False`` compiles them with the Pallas Triton
GPU backend (``bench/kernels_gpu.py`` checks and times them there).
"""
