"""Model builders and loaders (tiny from config, SmolLM2 from its GGUF, local HF folders)."""
