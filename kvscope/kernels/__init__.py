"""Attention backends over the global paged KV pool.

Every backend implements :class:`AttentionBackend`: write this step's K/V into the pool by
``slot_mapping``, then attend each packed query row to its sequence's whole history read
through ``block_tables`` (see :mod:`kvscope.forward_context`).
"""
