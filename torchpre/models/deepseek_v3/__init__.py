"""DeepSeek-V3: multi-head latent attention and fine-grained, bias-balanced experts (`model.name = "deepseek_v3"`)."""
