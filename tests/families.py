"""The families every engine-level test runs on (one list: dflash_core.shapes.FAMILIES, by model
type), their fixture names (`{name}_pair`, conftest.py), and the prompt the lossless tests use."""

from dflash_core.shapes import FAMILIES

# Fixture names are the model types, but Gemma 3's ("gemma3_text") is shortened.
FIXTURE_NAMES = {family: "gemma3" if family == "gemma3_text" else family for family in FAMILIES}
ENGINE_FAMILIES = [FIXTURE_NAMES[family] for family in FAMILIES]
MODEL_TYPES = {name: family for family, name in FIXTURE_NAMES.items()}


def sample_prompt(engine) -> list[int]:
    return engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. def f(x): return x * 2")


# Gemma 4 with an MoE block in every layer (as its 26B-A4B): the `gemma4_moe_pair` fixture.
GEMMA4_MOE = {"text_config": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                              "moe_intermediate_size": 16}}
