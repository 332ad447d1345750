"""Agentic RL: an OpenAI-compatible gateway in front of the rollout servers.

Agents written against the OpenAI API train by pointing ``base_url`` at a session of the
gateway (server.py). Each chat completion is one ``agenerate(input_ids)``; the ids of a
conversation are kept exactly as sampled across turns (chat.py, session.py), tool calls are
parsed per model family (tools.py), and credit is assigned per segment (credit.py).
"""
