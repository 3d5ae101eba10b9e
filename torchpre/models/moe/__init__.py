"""Mixture-of-Experts decoders (Mixtral / Qwen3-MoE style): Llama 3 attention, routed SwiGLU experts."""
