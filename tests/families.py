"""What the engine-level lossless tests share: the families they run on and the prompt they use."""

ENGINE_FAMILIES = ["qwen3", "qwen3_5", "qwen3_5_moe", "gemma4", "gemma3"]  # fixture names: {family}_pair


def sample_prompt(engine) -> list[int]:
    return engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. def f(x): return x * 2")
