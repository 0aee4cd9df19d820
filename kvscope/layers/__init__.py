"""Model building blocks, one concept per module: tensor-parallel linears and vocab embedding,
RoPE, RMSNorm, the gated activation, and the paged ``Attention`` layer."""
