"""Pallas kernels (segment attention, paged attention with eviction), each file holding its
jnp reference, input validators and block-size parameters (DESIGN.md §2.3).

The reference implementations are the CPU path; the kernels run on GPU/TPU and are tested
against the references in Pallas interpret mode on CPU. Kernels land with the
orchestration-core issue; the model's dense-mask attention
(``selforch_jax.models.transformer.attention``) is the reference they must match.
"""
