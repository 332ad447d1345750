"""Backend adapters: the rollout client, the embedded rollout server and the DeepSpeed trainer."""
