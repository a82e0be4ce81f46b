"""prism_megatron: run one rank of an N-rank Megatron-core job on one process (virtual world)."""
